"""Trainer peak memory and step time per micro-batch length, for each long-sequence memory saving.

    python scripts/bench_train_memory.py --json train_memory.json                        # CPU-sized: k3-tiny
    python scripts/bench_train_memory.py --device cuda --preset k3-small --lengths 1024,4096,16384,32768

One training step of the megatron policy (LoRA rank 8 on every default target, the reference init): a
forward over one sequence of L tokens, the chunked log-probs of random targets, -mean(logp), backward. Four
variants, each adding one saving to the one before:
- baseline: the code before issue 18: MLA through dense SDPA at every length (on CPU the math backend
  builds [H, L, L] scores; on CUDA SDPA's fused causal kernels already ran, so the next row matches it),
  every layer's activations kept, each log-prob chunk's logits saved for backward;
- mla: MLA's memory-efficient path (`miles_k3.ops.mla`: blockwise online softmax on CPU, SDPA `is_causal`
  on CUDA);
- recompute: + activation recompute per decoder layer (`parallel.recompute=true`);
- logprobs: + each chunk's logits recomputed in backward (the trainer's default since issue 18).
Each (length, variant) runs in a fresh process. Peak memory, the largest over the steps (the warm-up
included): on CUDA `max_memory_allocated` above what is allocated before the step; on CPU the process's peak
resident set (VmHWM, reset before the step) above its resident set then, with glibc's mmap threshold fixed so
freed tensors leave the resident set. Step time: the median of `--steps` steps after one warm-up. The loss is printed
so the variants can be seen to compute the same thing (they differ in summation order only).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("baseline", "mla", "recompute", "logprobs")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set size (VmHWM)
        f.write("5")


def measure(variant: str, length: int, args: argparse.Namespace) -> dict:
    """One (variant, length) in this process: build, warm up, time, report the peak."""
    import miles_k3.ops.mla as mla
    from megatron_patches.model import build_policy
    from megatron_patches.vocab_parallel import token_logprobs
    from miles_k3.model.config import K3Config
    from miles_k3.model.lora_spec import LoraSpec
    from miles_k3.model.modeling import reference_state

    torch.set_num_threads(args.threads)
    level = VARIANTS.index(variant)
    if level == 0:
        mla.DENSE_MAX_KEYS = 1 << 62  # the dense SDPA path at every length, as before
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = K3Config.from_preset(args.preset)
    policy = build_policy(
        config, reference_state(config, 0), LoraSpec(rank=8), dtype=dtype, device=args.device, recompute=level >= 2
    )
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, config.vocab_size, (1, length), generator=g).to(args.device)
    targets = torch.randint(3, config.vocab_size, (length,), generator=g).to(args.device)
    cu = torch.tensor([0, length], dtype=torch.int32, device=args.device)

    def step() -> float:
        policy.zero_grad(set_to_none=True)
        hidden = policy.model(ids, cu_seqlens=cu)
        logp, _ = token_logprobs(policy, hidden[0], targets, 1.0, recompute_logits=level >= 3)
        loss = -logp.mean()
        loss.backward()
        return float(loss.detach())

    times, peak = [], 0
    for i in range(args.steps + 1):  # step 0 warms up (allocator, autotuning): timed no, measured yes
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the heap holds free goes back first
            _reset_peak_rss()
            base = _rss_kib("VmRSS") * 1024
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
        peak = max(peak, (torch.cuda.max_memory_allocated() if cuda else _rss_kib("VmHWM") * 1024) - base)
    return {
        "variant": variant,
        "tokens": length,
        "peak_bytes": peak,
        "step_s": statistics.median(times),
        "tokens_per_s": length / statistics.median(times),
        "loss": loss,
    }


def _child(conn, variant: str, length: int, args: argparse.Namespace) -> None:
    try:
        conn.send(measure(variant, length, args))
    except torch.OutOfMemoryError:
        conn.send({"variant": variant, "tokens": length, "oom": True})
    finally:
        conn.close()


def run(variant: str, length: int, args: argparse.Namespace) -> dict:
    # a fixed mmap threshold: glibc then maps every large tensor on its own and unmaps it when freed, so the
    # child's resident set follows the tensors alive (its dynamic threshold would keep freed ones in the heap)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, variant, length, args))
    proc.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError:  # killed (the host's memory) or crashed
        result = {"variant": variant, "tokens": length, "failed": True}
    proc.join()
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--lengths", default="512,1024,2048", help="comma-separated tokens per micro-batch")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    args.variants = args.variants.split(",")
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    if min(args.lengths) < 2 or args.steps < 1:
        raise SystemExit("--lengths must be >= 2 and --steps >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    print(
        f"trainer step memory, {args.preset}, one sequence per micro-batch, LoRA r8, "
        f"{'bf16 cuda' if args.device == 'cuda' else 'fp32 cpu'}"
    )
    print(f"{'tokens':>7} {'variant':>10} {'peak MiB':>10} {'vs base':>8} {'step s':>8} {'tok/s':>8} {'loss':>9}")
    rows = []
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} {os.cpu_count()} cpus"
    result = {
        "rows": rows,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": "python scripts/bench_train_memory.py " + " ".join(argv),
        "env": {
            "torch": torch.__version__,
            "device": device,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    for length in args.lengths:
        base = None
        for variant in args.variants:
            r = run(variant, length, args)
            rows.append(r)
            if args.json:  # after every row: a run cut short keeps what it measured
                args.json.write_text(json.dumps(result, indent=2) + "\n")
            if "peak_bytes" not in r:
                print(f"{length:>7} {variant:>10} {'OOM' if r.get('oom') else 'failed':>10}", flush=True)
                continue
            base = base or max(r["peak_bytes"], 1)
            print(
                f"{length:>7} {variant:>10} {r['peak_bytes'] / 2**20:10.1f} {r['peak_bytes'] / base:7.2f}x "
                f"{r['step_s']:8.2f} {r['tokens_per_s']:8.0f} {r['loss']:9.5f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
