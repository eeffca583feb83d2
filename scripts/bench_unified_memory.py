"""Unified memory vs two pools: how many requests run at once, at equal bytes, for two opposite workloads.

    python scripts/bench_unified_memory.py --json bench_unified_memory.json              # k3-tiny on cpu
    python scripts/bench_unified_memory.py --device cuda --json bench_unified_memory.json  # k3-small, bf16

Two pools split `memory_bytes` once (`EngineConfig.state_fraction`): KDA state slots on one side, MLA KV
pages on the other. `unified_memory=True` carves both from one byte pool (`rollout/unified_memory.py`). A
request holds one working slot and a page per `page_size` tokens, so a short request is mostly slot and a
long one mostly pages: a fixed split suits one workload and starves the other.

Workloads (every request submitted at once, greedy, no stop token, so every run computes the same tokens):
- short: --short-requests prompts of --short-prompt tokens, --short-gen new tokens each;
- long: --long-requests prompts of --long-prompt tokens, --long-gen new tokens each.

Each workload runs on a fresh engine of --memory-mb bytes per configuration: two pools at state_fraction
0.5 (the default), two pools at the best fixed split for the workload, and unified. The best split is
searched around the one where slots and pages run out together for this workload (slot_bytes /
(slot_bytes + pages_per_request * page_bytes)), at that value and +-0.05 (or --splits), and the best
measured is kept (most requests decoding at once on average, then fewest steps). Per run: peak and mean
requests decoding together (their prompt computed and its KV held) over the steps where any decodes, steps
to finish, retractions, and whether every request finished with all its tokens.
Capacity is counted, not timed (wall seconds are reported for information only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from miles_k3.model import K3Config, K3ForCausalLM  # noqa: E402
from rollout.config import EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.memory import PoolSizes  # noqa: E402
from rollout.request import SamplingParams  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# k3-tiny: a slot is the bytes of ~219 tokens of KV (fp32, pages of 16); k3-small: ~2,544 (bf16)
DEVICE_DEFAULTS = {
    "cpu": dict(
        preset="k3-tiny",
        dtype="fp32",
        memory_mb=1.25,
        short_requests=24,
        short_prompt=16,
        short_gen=8,
        long_requests=6,
        long_prompt=600,
        long_gen=8,
        max_prefill_tokens=512,
    ),
    "cuda": dict(
        preset="k3-small",
        dtype="bf16",
        memory_mb=128.0,
        short_requests=48,
        short_prompt=128,
        short_gen=32,
        long_requests=8,
        long_prompt=8192,
        long_gen=32,
        max_prefill_tokens=2048,
    ),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=sorted(DEVICE_DEFAULTS))
    ap.add_argument("--preset", help="model preset (default: k3-tiny on cpu, k3-small on cuda)")
    ap.add_argument("--dtype", choices=sorted(DTYPES))
    ap.add_argument("--memory-mb", type=float, help="EngineConfig.memory_bytes in MiB, the same for every run")
    for kind in ("short", "long"):
        ap.add_argument(f"--{kind}-requests", type=int)
        ap.add_argument(f"--{kind}-prompt", type=int, help="prompt tokens")
        ap.add_argument(f"--{kind}-gen", type=int, help="new tokens")
    ap.add_argument("--workloads", default="short,long")
    ap.add_argument(
        "--splits",
        help="comma-separated state_fraction values to search for the best split "
        "(default: around the workload's balanced split)",
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--max-prefill-tokens", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    for k, v in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for kind in ("short", "long"):
        for what in ("requests", "prompt", "gen"):
            if getattr(args, f"{kind}_{what}") < 1:
                ap.error(f"--{kind}-{what} must be >= 1")
    if args.memory_mb <= 0:
        ap.error("--memory-mb must be > 0")
    bad = set(args.workloads.split(",")) - {"short", "long"}
    if bad:
        ap.error(f"--workloads: unknown {sorted(bad)} (short, long)")
    return args


def run(model: K3ForCausalLM, prompts: list[list[int]], gen: int, cfg: EngineConfig) -> dict:
    """Submit every prompt at once and step to the end, counting the requests decoding after each step."""
    eng = Engine(model, cfg)
    params = SamplingParams(temperature=0, max_new_tokens=gen)
    ids = [eng.submit(p, params) for p in prompts]
    decoding, done, steps = [], {}, 0
    start = time.perf_counter()
    while eng.has_work() and steps < 100_000:
        done.update((c.request_id, c) for c in eng.step())
        decoding.append(sum(not r.prefilling for r in eng.scheduler.running))
        steps += 1
    decoding = [d for d in decoding if d] or [0]
    wall = time.perf_counter() - start
    finished = all(i in done and len(done[i].output_ids) == gen for i in ids)
    sizes = eng.memory.sizes
    return {
        "state_fraction": None if cfg.unified_memory else cfg.state_fraction,
        "slots": sizes.num_slots,
        "pages": sizes.num_pages,
        "peak_decoding": max(decoding),
        "mean_decoding": sum(decoding) / len(decoding),
        "steps": steps,
        "retractions": eng.counters()["retractions"],
        "finished": finished,
        "wall_s": wall,
    }


def balanced_split(config: K3Config, args, dtype, prompt: int, gen: int) -> float:
    """The state_fraction at which this workload's requests run out of slots and pages together."""
    page_bytes = PoolSizes.bytes_per_page(config, args.page_size, dtype)
    slot_bytes = PoolSizes.bytes_per_slot(config, dtype)
    pages = -(-(prompt + gen) // args.page_size)
    return slot_bytes / (slot_bytes + pages * page_bytes)


def better(a: dict, b: dict) -> bool:
    return (a["finished"], a["mean_decoding"], -a["steps"]) > (b["finished"], b["mean_decoding"], -b["steps"])


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    config = K3Config.from_preset(args.preset)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = K3ForCausalLM(config).to(dtype).eval()
    memory = int(args.memory_mb * 2**20)
    base = dict(
        memory_bytes=memory,
        page_size=args.page_size,
        chunk_size=args.chunk_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_seq_len=max(args.short_prompt + args.short_gen, args.long_prompt + args.long_gen),
        max_running=max(args.short_requests, args.long_requests),
    )
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for workload in args.workloads.split(","):
        n, plen, glen = (getattr(args, f"{workload}_{k}") for k in ("requests", "prompt", "gen"))
        prompts = [torch.randint(3, config.vocab_size, (plen,), generator=gen).tolist() for _ in range(n)]
        balanced = balanced_split(config, args, dtype, plen, glen)
        splits = (
            [float(s) for s in args.splits.split(",")]
            if args.splits
            else sorted({min(0.95, max(0.05, round(balanced + d, 3))) for d in (-0.05, 0.0, 0.05)})
        )
        default = run(model, prompts, glen, EngineConfig(**base))
        best = None
        for sf in splits:
            try:
                r = run(model, prompts, glen, EngineConfig(**base, state_fraction=sf))
            except ValueError as e:  # a split that holds no slot or too few pages for one request
                print(f"{workload}: state_fraction {sf}: {e}", flush=True)
                continue
            if best is None or better(r, best):
                best = r
        one = run(model, prompts, glen, EngineConfig(**base, unified_memory=True))
        for label, r in (("two pools, state_fraction 0.5", default), ("two pools, best split", best), ("unified", one)):
            if r is None:
                continue
            row = {"workload": workload, "requests": n, "prompt": plen, "gen": glen, "memory": label, **r}
            rows.append(row)
            print("row", json.dumps(row), flush=True)

    result = {
        "meta": {
            "preset": args.preset,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else (platform.processor() or platform.machine()),
            "dtype": args.dtype,
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "scripts/bench_unified_memory.py", *argv]),
            "memory_bytes": memory,
            "page_size": args.page_size,
            "chunk_size": args.chunk_size,
            "slot_bytes": PoolSizes.bytes_per_slot(config, dtype),
            "page_bytes": PoolSizes.bytes_per_page(config, args.page_size, dtype),
        },
        "rows": rows,
    }
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_table(result: dict) -> None:
    m = result["meta"]
    print(
        f"\n{m['preset']} {m['dtype']} on {m['device_name']}, {m['memory_bytes'] / 2**20:g} MiB per "
        f"configuration (slot {m['slot_bytes']} B, page of {m['page_size']} tokens {m['page_bytes']} B)"
    )
    head = (
        f"{'workload':<28} {'memory':<30} {'split':>6} {'slots':>6} {'pages':>6} {'peak':>5} {'mean':>6} "
        f"{'steps':>6} {'retract':>7} {'done':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        work = f"{r['workload']} ({r['requests']} x {r['prompt']}+{r['gen']})"
        split = "-" if r["state_fraction"] is None else f"{r['state_fraction']:.3g}"
        print(
            f"{work:<28} {r['memory']:<30} {split:>6} {r['slots']:>6} {r['pages']:>6} {r['peak_decoding']:>5} "
            f"{r['mean_decoding']:>6.1f} {r['steps']:>6} {r['retractions']:>7} {str(r['finished']):>5}"
        )
    print(
        "slots / pages: the most of each kind the memory holds (unified: next to one block of the other kind); "
        "peak / mean: requests decoding together (their whole prompt computed), over the steps where any does"
    )


if __name__ == "__main__":
    main()
