"""Count the ops a DSpark drafter runs per verify step, by batch size: a device-independent proxy for its kernel
launches, which on a GPU are host time in the speculative step's serial path.

    python scripts/count_spec_ops.py --batch-sizes 8,64,256 [--samples K] [--temperature T] [--json ops.json]

Runs the shipped long-output pair (`miles_k3/assets/k3-tiny-steps` and its drafter) on CPU, greedy (or
sampled at `--temperature`, where the drafter draws its tokens), its
held-out prompts (`--samples K`: batch / K prompts, each K times, as a GRPO group), and counts every aten op
dispatched inside the drafter's `propose` (the catch-up target pass of newly admitted requests, the block
forward, the draws) and `observe` (the committed features into each request's context window), per verify
step, with the run's wall seconds (on a CPU the catch-up's compute shows there). Work that does not grow
with the batch stays flat; a per-row loop shows as ops growing with it (2026-12-04: the context windows
were a slice, a cat and two copies a row).
The target's own verify forward and fold are CUDA graphs on a GPU and not counted here: `profile_spec.py`
times the whole step there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import build_target, prompts_for  # noqa: E402

from rollout.config import EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.request import SamplingParams  # noqa: E402
from rollout.spec import SpecConfig  # noqa: E402
from rollout.spec.drafter import DSparkDrafter  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "miles_k3" / "assets" / "k3-tiny-steps"  # target; drafter in drafter/


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class CountingDrafter(DSparkDrafter):
    """The DSpark drafter, counting the ops of its engine calls (`ops[name]`, summed over the run)."""

    def __init__(self, config):
        super().__init__(config)
        self.ops = {"propose": 0, "observe": 0}

    def propose(self, *args):
        with _Count() as c:
            out = super().propose(*args)
        self.ops["propose"] += c.ops
        return out

    def observe(self, *args):
        with _Count() as c:
            super().observe(*args)
        self.ops["observe"] += c.ops


def count(batch: int, gen_len: int, samples: int = 1, temperature: float = 0.0) -> dict:
    _, model = build_target(str(PAIR), torch.float32, "cpu")
    drafter = CountingDrafter.load(PAIR / "drafter", model)
    prompts = [p for p in prompts_for(PAIR, -(-batch // samples)) for _ in range(samples)][:batch]
    engine = Engine(
        model,
        EngineConfig(
            memory_bytes=1 << 30,
            max_running=batch,
            max_seq_len=256,
            speculation=SpecConfig(drafter=drafter, gamma=drafter.config.block_size),
        ),
    )
    start = time.perf_counter()
    engine.generate(
        prompts, SamplingParams(temperature=temperature, max_new_tokens=gen_len, stop_token_ids=(2,), seed=0)
    )
    wall = time.perf_counter() - start
    steps = engine.decoder.strategy.stats.steps
    return dict(
        batch=batch,
        samples=samples,
        temperature=temperature,
        steps=steps,
        wall_s=round(wall, 2),
        **{f"{k}_ops_per_step": round(v / steps, 1) for k, v in drafter.ops.items()},
    )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="8,64,256")
    ap.add_argument("--gen-len", type=int, default=16, help="new tokens per request")
    ap.add_argument("--samples", type=int, default=1, help="requests per prompt (a GRPO group's size)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [count(int(b), args.gen_len, args.samples, args.temperature) for b in args.batch_sizes.split(",")]
    print(
        "| batch | samples a prompt | verify steps | wall s | propose ops / step | observe ops / step |\n"
        "|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['batch']} | {r['samples']} | {r['steps']} | {r['wall_s']} | {r['propose_ops_per_step']} | "
            f"{r['observe_ops_per_step']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
