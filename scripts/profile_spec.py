"""Where a speculative decode step's time goes: torch.profiler over one timed `generate`, plain and speculative.

    python scripts/profile_spec.py --device cuda --batch-sizes 1,256 --planners verify_all,cost_aware

Same target and drafter as `bench_spec.py --target preset:k3-small --peaked --drafter controlled:P` (random
prompts, greedy). Per (batch, engine) it prints the wall time, then the spec step's phases (the
`spec.*` record_function labels of `rollout.spec.strategy`) with their host and device time, then the
ops with the most device time and those with the most host time. A diagnostic: figures for the docs come
from bench_spec.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import build_target, free, prefill_budget, random_prompts, shadow_drafter, warm_up  # noqa: E402
from controlled_drafter import ControlledDrafter  # noqa: E402

from rollout.config import EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.request import SamplingParams  # noqa: E402
from rollout.spec import SpecConfig  # noqa: E402


def profiled(engine: Engine, prompts, params, device: str, rows: int):
    warm_up(engine, prompts, params)  # as bench_spec.py's: until two runs in a row capture no graph
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    stats = getattr(engine.decoder.strategy, "stats", None)
    caught = f", {stats.captures} graphs captured" if stats is not None else ""
    print(f"   wall {wall:.3f} s, {tokens} tokens, {tokens / wall:.1f} tok/s{caught}", flush=True)
    ev = prof.key_averages()
    dev = "device_time_total" if hasattr(ev[0], "device_time_total") else "cuda_time_total"
    phases = [e for e in ev if e.key.startswith("spec.")]
    for e in sorted(phases, key=lambda e: e.key):
        print(
            f"   {e.key:22s} calls {e.count:5d}  host {e.cpu_time_total / 1e3:9.1f} ms  "
            f"device {getattr(e, dev) / 1e3:9.1f} ms",
            flush=True,
        )
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(ev.table(sort_by=sort, row_limit=rows), flush=True)
    print(ev.table(sort_by="cpu_time_total", row_limit=rows), flush=True)
    return outs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="preset:k3-small")
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--planners", default="verify_all,cost_aware")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--memory-gb", type=float, default=16)
    ap.add_argument("--rows", type=int, default=25, help="op rows per table")
    ap.add_argument(
        "--drafter-cost",
        choices=("none", "dspark"),
        default="none",
        help="dspark: an untrained DSpark drafter runs alongside (bench_spec.py's flag of that name)",
    )
    args = ap.parse_args(argv)
    config, model = build_target(args.target, getattr(torch, args.dtype), args.device, peaked=True)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = random_prompts(b, args.prompt_len, config.vocab_size)
        params = [SamplingParams(temperature=0.0, max_new_tokens=args.gen_len, stop_token_ids=(2,)) for _ in prompts]
        ecfg = dict(
            memory_bytes=int(args.memory_gb * 2**30),
            max_running=b,
            max_seq_len=max(256, args.prompt_len + args.gen_len + args.gamma + 1),
            **prefill_budget(args.device, None),
        )
        print(f"== batch {b}: plain", flush=True)
        plain = profiled(Engine(model, EngineConfig(**ecfg)), prompts, params, args.device, args.rows)
        free(args.device)
        shadow = shadow_drafter(config, args.gamma) if args.drafter_cost == "dspark" else None
        drafter = ControlledDrafter(
            {tuple(p): o.output_ids for p, o in zip(prompts, plain)}, config.vocab_size, args.acceptance, shadow=shadow
        )
        for planner in args.planners.split(","):
            print(f"== batch {b}: speculative, {planner}", flush=True)
            cfg = EngineConfig(**ecfg, speculation=SpecConfig(drafter=drafter, gamma=args.gamma, planner=planner))
            profiled(Engine(model, cfg), prompts, params, args.device, args.rows)
            free(args.device)


if __name__ == "__main__":
    main()
