"""What the trainer's chunked log-probs save against the full-logits path, on one device.

    python scripts/bench_logprobs.py --device cuda --tokens 8192,32768 --json logprobs.json

The trainer's loss needs log pi(target) (and the entropy) at every response token. The full path computes
logits [M, V] in the model's dtype, upcasts them to fp32 and takes log_softmax: with K3's vocabulary
(163,840) that is 640 KB a token in fp32, 21 GB at 32k tokens, plus its gradient. `token_logprobs`
(megatron_patches/vocab_parallel.py) reads [chunk, V] logits at a time; its default ("chunked") keeps only
each chunk's hidden rows and log-normalizer and computes the chunk's logits again in backward, the earlier
form ("saved", `recompute_logits=False`) saves each chunk's logits in the model's dtype (10 GiB at 32k
tokens). All run here on the same bf16 head (K3's vocab and hidden size, random weights) and hidden
states, forward and backward; the table has the peak memory above the inputs, the median time of `--steps`
steps after one warm-up, and the largest difference of log-probs and of the hidden states' gradient against
the full path (fp32 maths in all; the difference is summation order).
TP = 1: the vocab-parallel reduction over a TP group is the same code with a group of one (CPU tests hold
TP = 2 exact against it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from megatron_patches.vocab_parallel import DEFAULT_CHUNK, vocab_parallel_logprobs


def full_logprobs(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The full path: [M, V] logits, fp32 log_softmax, gather, entropy."""
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def chunked_logprobs(weight, hidden, targets, temperature, chunk, recompute_logits=True):
    return vocab_parallel_logprobs(
        lambda h: h @ weight.t(),
        hidden,
        targets,
        temperature,
        with_entropy=True,
        chunk_size=chunk,
        recompute_logits=recompute_logits,
    )


def measure(fn, hidden: torch.Tensor, steps: int, device: str) -> dict:
    """Peak bytes above what is allocated before (inputs and weights), median step time, outputs."""
    times, peak = [], 0
    for step in range(steps + 1):
        h = hidden.detach().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        logp, entropy = fn(h)
        (logp.sum() + 0 * entropy.sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        if step:
            times.append(time.perf_counter() - start)
    return {
        "logp": logp.detach(),
        "grad": h.grad.detach(),
        "entropy": entropy.detach(),
        "peak_bytes": peak,
        "step_ms": 1e3 * statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="8192,32768", help="comma-separated M values")
    parser.add_argument("--vocab", type=int, default=163840, help="K3's vocabulary")
    parser.add_argument("--hidden", type=int, default=7168, help="K3's hidden size")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).to(args.device, dtype)
    rows = []
    print(f"{'tokens':>7} {'path':>8} {'peak GiB':>9} {'ms':>8} {'max|d logp|':>12} {'max|d grad|/max|grad|':>22}")
    for m in (int(x) for x in args.tokens.split(",")):
        hidden = torch.randn(m, args.hidden, generator=g).to(args.device, dtype)
        targets = torch.randint(0, args.vocab, (m,), generator=g).to(args.device)
        results = {}
        for name, fn in [
            ("chunked", lambda h, t=targets: chunked_logprobs(weight, h, t, args.temperature, args.chunk)),
            (
                "saved",
                lambda h, t=targets: chunked_logprobs(
                    weight, h, t, args.temperature, args.chunk, recompute_logits=False
                ),
            ),
            ("full", lambda h, t=targets: full_logprobs(weight, h, t, args.temperature)),
        ]:
            try:
                results[name] = measure(fn, hidden, args.steps, args.device)
            except torch.OutOfMemoryError:
                results[name] = None
                torch.cuda.empty_cache()
        for name, r in results.items():
            row = {
                "tokens": m,
                "path": name,
                "chunk": None if name == "full" else args.chunk,
                "peak_bytes": None if r is None else r["peak_bytes"],
                "step_ms": None if r is None else r["step_ms"],
            }
            if r is not None and results.get("full") is not None and name != "full":
                full = results["full"]
                row["max_abs_logp_diff"] = float((r["logp"] - full["logp"]).abs().max())
                row["max_abs_entropy_diff"] = float((r["entropy"] - full["entropy"]).abs().max())
                row["grad_rel_diff"] = float(
                    (r["grad"].float() - full["grad"].float()).abs().max() / full["grad"].float().abs().max()
                )
            rows.append(row)
            peak = "OOM" if r is None else f"{r['peak_bytes'] / 2**30:.2f}"
            ms = "" if r is None else f"{r['step_ms']:.1f}"
            print(
                f"{m:>7} {name:>8} {peak:>9} {ms:>8} {row.get('max_abs_logp_diff', ''):>12} "
                f"{row.get('grad_rel_diff', ''):>22}",
                flush=True,
            )
        del hidden, targets, results
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "dtype": str(dtype),
            "vocab": args.vocab,
            "hidden": args.hidden,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
