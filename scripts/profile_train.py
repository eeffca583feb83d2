"""Where the GRPO train phase's time goes: our `TrainWorker.train` against PEFT on transformers (TRL's train
phase), same model, same tokens, same run.

    python scripts/profile_train.py --device cuda --preset k3-small --json profile_train.json
    python scripts/profile_train.py --preset k3-tiny --samples 4 --response-len 64   # CPU smoke run

Ours: the trainer `miles-train recipe=k3_small_gpu` builds (Hydra-composed, the same overrides as
`bench_grpo_trl.py`: the Kimi-Linear form of the preset from one HF checkpoint, LoRA rank 16 on the default
targets, token-mean loss, one optimizer step), trained on a synthetic batch of --samples sequences of
--prompt-len + --response-len tokens, micro-batched by the recipe's `parallel.micro_batch_tokens`. The
peer: `KimiLinearForCausalLM` from the same checkpoint with PEFT LoRA on the same modules, forward and
backward over the same sequences in micro-batches of --peer-micro-batch, the response tokens' log-probs
gathered from the logits as TRL does, then one AdamW step. Each side: --warmup untimed steps (fla autotunes
in the first), the median of --steps timed ones, then one step under torch.profiler (its kernels by device
time, the device's busy time against the wall) and on CUDA one more in CUDA's sync debug mode (the lines
where the host waited for the device). `--count-ops N` counts our step's compute ops by source line (the
launches of the host-bound CUDA step, countable on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpo_trl import ALGO_OVERRIDES, PEFT_TARGET_MODULES, PEFT_TARGET_PARAMETERS, write_base  # noqa: E402

SYNCS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def synthetic_rows(args, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.samples, args.prompt_len), generator=g).tolist()
    responses = torch.randint(3, vocab, (args.samples, args.response_len), generator=g).tolist()
    return prompts, responses


def ours(args, base_dir: Path, rows) -> callable:
    """A step of our trainer over the rows (the loop's own TrainWorker, built from the composed recipe)."""
    from hydra import compose, initialize_config_module

    from megatron_patches.parallel import ensure_parallel
    from miles_k3.trainer.base import load_base
    from miles_k3.trainer.batch import TrainBatch
    from miles_k3.trainer.config import register_schema
    from miles_k3.trainer.resolve import resolve
    from miles_k3.trainer.workers import build_train_worker

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    register_schema()
    with initialize_config_module(config_module="recipes", version_base=None):
        cfg = compose(
            config_name="train",
            overrides=[
                "recipe=k3_small_gpu",
                f"cluster={'gpu_single' if args.device == 'cuda' else 'local_cpu'}",
                f"model.path={base_dir}",
                "model.preset=null",
                "model.vocab_size=null",
                f"model.train_dtype={dtype}",
                f"lora.rank={args.rank}",
                f"lora.alpha={args.alpha}",
                *ALGO_OVERRIDES,
                *args.override,
            ],
        )
    rc = resolve(cfg)
    ensure_parallel()
    config, state = load_base(rc.model, 0)
    worker = build_train_worker(rc, config, state, "cuda:0" if args.device == "cuda" else "cpu")
    prompts, responses = rows
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch.of(
        prompts,
        responses,
        [[-1.0] * len(r) for r in responses],
        torch.randn(len(prompts), generator=g).tolist(),
        [i // 8 for i in range(len(prompts))],
    )
    return lambda: worker.train(batch)


def peer(args, base_dir: Path, rows) -> callable:
    """A TRL-style train step: PEFT LoRA on transformers' KimiLinear, token log-probs from the logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import KimiLinearForCausalLM

    if args.device != "cuda":
        from miles_k3.compat.transformers_kimi import use_torch_fallbacks

        use_torch_fallbacks()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = KimiLinearForCausalLM.from_pretrained(base_dir, dtype=dtype).to(args.device)
    model = get_peft_model(
        model,
        LoraConfig(
            r=args.rank,
            lora_alpha=args.alpha,
            lora_dropout=0.0,
            target_modules=PEFT_TARGET_MODULES,
            target_parameters=PEFT_TARGET_PARAMETERS,
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    prompts, responses = rows
    ids = torch.tensor([p + r for p, r in zip(prompts, responses)], device=args.device)
    n_resp = args.response_len

    def step():
        opt.zero_grad(set_to_none=True)
        for mb in ids.split(args.peer_micro_batch):
            logits = model(input_ids=mb).logits[:, -n_resp - 1 : -1].float()
            logp = torch.gather(logits.log_softmax(-1), 2, mb[:, -n_resp:, None]).squeeze(-1)
            (-logp.mean() * len(mb) / len(ids)).backward()
        opt.step()

    return step


# aten ops that only make views or read metadata: no kernel on CUDA
VIEWS = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "detach",
    "alias",
    "as_strided",
    "split",
    "split_with_sizes",
    "unbind",
    "reshape",
    "unflatten",
    "flatten",
    "lift_fresh",
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "_local_scalar_dense",
}


def count_ops(step, top: int) -> dict:
    """One step's aten compute ops (each a kernel launch on CUDA), in total and by the repo source line that
    issued them; a backward op counts against the forward line whose autograd node ran it ("bwd " + line:
    anomaly mode records each node's forward stack). A CPU proxy for the host-bound CUDA step's launches: the
    CPU runs other code in a few places (the KDA recurrence's reference, the experts' loop in fp32)."""
    import re
    import traceback
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    repo = str(Path(__file__).resolve().parents[1]) + "/"
    lines: Counter = Counter()

    def in_repo(path: str) -> bool:
        return path.startswith(repo) and "/.venv/" not in path and not path.endswith("profile_train.py")

    def forward_line(node) -> str | None:
        frames = re.findall(r'File "([^"]+)", line (\d+)', "".join(node.metadata.get("traceback_", [])))
        mine = [(f, n) for f, n in frames if in_repo(f)]
        return f"bwd {mine[-1][0][len(repo) :]}:{mine[-1][1]}" if mine else None

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in VIEWS:
                node = torch._C._current_autograd_node()
                where = forward_line(node) if node is not None else None
                if where is None:
                    frames = [f for f in traceback.extract_stack()[:-1] if in_repo(f.filename)]
                    where = f"{frames[-1].filename[len(repo) :]}:{frames[-1].lineno}" if frames else "(elsewhere)"
                lines[where] += 1
            return func(*args, **(kwargs or {}))

    with torch.autograd.set_detect_anomaly(True, check_nan=False), Counting():
        step()
    return {"ops": sum(lines.values()), "by_line": dict(lines.most_common(top))}


def sync_sources(step) -> dict[str, int]:
    """One more step with CUDA's sync debug mode: where the host waited for the device (file:line, count)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sources: dict[str, int] = {}
    for w in caught:
        if "synchronizing" in str(w.message):
            where = f"{w.filename.split('site-packages/')[-1]}:{w.lineno}"
            sources[where] = sources.get(where, 0) + 1
    return dict(sorted(sources.items(), key=lambda kv: -kv[1])[:15])


def timed(step, args) -> dict:
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        print(f"  step {i}: {time.perf_counter() - start:.3f} s", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = sorted(
        (e for e in events if getattr(e, attr) > 0 and (not cuda or e.device_type.name == "CUDA")),
        key=lambda e: -getattr(e, attr),
    )
    busy = sum(getattr(e, attr) for e in kernels) / 1e6
    syncs = {e.key: e.count for e in events if e.key in SYNCS}
    sources = sync_sources(step) if cuda else {}
    return {
        "step_s": statistics.median(times),
        "times_s": times,
        "profiled_wall_s": wall,
        "busy_s": busy,
        "syncs": syncs,
        "sync_sources": sources,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "launches": sum(e.count for e in kernels),
        "top": [{"name": e.key[:90], "calls": e.count, "ms": getattr(e, attr) / 1e3} for e in kernels[: args.top]],
    }


def report(name: str, res: dict, tokens: int) -> None:
    print(
        f"\n{name}: step {res['step_s']:.3f} s ({tokens / res['step_s']:,.0f} tokens/s); profiled step "
        f"{res['profiled_wall_s']:.3f} s, device busy {res['busy_s']:.3f} s "
        f"({100 * res['busy_s'] / res['profiled_wall_s']:.0f}%), {res['launches']:,} kernels; syncs {res['syncs']}"
    )
    print(f"  peak memory {res['peak_gib']} GiB; where the host waited for the device:")
    for where, n in res["sync_sources"].items():
        print(f"    {n:5d}  {where}")
    print(f"  {'kernel':90s} {'calls':>6s} {'ms':>9s} {'%':>5s}")
    for k in res["top"]:
        print(f"  {k['name']:90s} {k['calls']:6d} {k['ms']:9.2f} {100 * k['ms'] / 1e3 / res['busy_s']:5.1f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--samples", type=int, default=32, help="sequences in the batch (the GRPO step's 512 / 16)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--peer-micro-batch", type=int, default=32, help="the peer's sequences per forward/backward")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--vocab-size", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30, help="kernels listed per side")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument(
        "--count-ops",
        type=int,
        metavar="N",
        help="also count our step's aten compute ops (the CUDA "
        "step's kernel launches, counted on any device) and print the N source lines with most",
    )
    ap.add_argument("--override", action="append", default=[], help="a Hydra override for our trainer (repeat)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    base_dir = Path(tempfile.mkdtemp(prefix="profile_train_")) / "kimi-linear-base"
    config = write_base(args.preset, args.vocab_size, base_dir)
    rows = synthetic_rows(args, config.vocab_size)
    tokens = args.samples * (args.prompt_len + args.response_len)
    out = {
        "meta": {
            "preset": args.preset,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "tokens": tokens,
            "args": vars(args) | {"json": str(args.json)},
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
        }
    }
    print(f"{args.preset}, {args.samples} x ({args.prompt_len} + {args.response_len}) tokens, {args.device}")
    print("miles-k3 TrainWorker.train:", flush=True)
    step = ours(args, base_dir, rows)
    out["miles-k3"] = timed(step, args)
    report("miles-k3", out["miles-k3"], tokens)
    if args.count_ops:
        out["miles-k3"]["count"] = counted = count_ops(step, args.count_ops)
        print(f"\nmiles-k3: {counted['ops']:,} aten compute ops a step; by source line:")
        for where, n in counted["by_line"].items():
            print(f"  {n:6d}  {where}")
    if not args.skip_peer:
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print("\nPEFT on transformers KimiLinear:", flush=True)
        out["peft"] = timed(peer(args, base_dir, rows), args)
        report("PEFT + transformers", out["peft"], tokens)
        print(f"\nmiles-k3 / PEFT step time: {out['miles-k3']['step_s'] / out['peft']['step_s']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
