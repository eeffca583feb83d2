"""What sequence parallelism saves and costs in the trainer: activation memory and step time per rank.

    python scripts/bench_sequence_parallel.py --preset k3-tiny --seq-len 4096 --json sp.json

Runs the megatron policy (LoRA rank 8 on every default target) forward and backward on one row of
`--seq-len` random tokens in three layouts: TP=1, TP=2, TP=2 with sequence parallelism (two processes,
gloo on CPU, nccl with `--device cuda` and two GPUs). Per rank it reports the bytes autograd saves for
the backward (every saved tensor's storage counted once, through `torch.autograd.graph.saved_tensors_hooks`,
parameters and buffers left out: the activation memory of a training step, independent of the allocator) and the median
wall time of a step after one warm-up step. The loss is logsumexp of the logits, so the number does not depend on a
label layout. On CPU the time is gloo on shared cores, a sanity figure rather than a cluster's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = {"TP=1": (1, False), "TP=2": (2, False), "TP=2 + SP": (2, True)}


def _saved_bytes_hooks(seen: dict[tuple[int, str], int], weights: set[tuple[int, str]]):
    """Count the storages autograd saves, except the model's own tensors (a linear saves its frozen
    weight for the input gradient: that is parameter memory, there anyway)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if key not in weights:
            seen[key] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, sequence_parallel: bool, out: str) -> None:
    from megatron_patches.model import build_policy
    from megatron_patches.parallel import destroy_parallel, end_world, init_parallel
    from miles_k3.model.config import K3Config
    from miles_k3.model.lora_spec import LoraSpec
    from miles_k3.model.modeling import reference_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // world))
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        init_parallel(world)
        config = K3Config.from_preset(args.preset)
        policy = build_policy(
            config,
            reference_state(config, 0),
            LoraSpec(rank=8),
            dtype=torch.float32,
            device=device,
            sequence_parallel=sequence_parallel,
        )
        ids = torch.randint(3, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        weights = {(t.untyped_storage().data_ptr(), str(t.device)) for t in [*policy.parameters(), *policy.buffers()]}
        times, saved = [], {}
        for step in range(args.steps + 1):
            policy.zero_grad(set_to_none=True)
            seen: dict[tuple[int, str], int] = {}
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with _saved_bytes_hooks(seen, weights):
                # the lm_head is vocab-parallel: gather the ranks' vocab slices for the full logsumexp
                loss = policy.tp.gather_last_dim(policy(ids).logits).float().logsumexp(-1).mean()
            loss.backward()
            if device != "cpu":
                torch.cuda.synchronize()
            if step:  # step 0 warms up
                times.append(time.perf_counter() - start)
            saved = seen
        result = {
            "rank": rank,
            "saved_bytes": sum(saved.values()),
            "step_s": statistics.median(times),
            "loss": float(loss.detach()),
        }
        torch.save(result, f"{out}/rank{rank}.pt")
        destroy_parallel()
    finally:
        end_world()


def measure(layout: str, args: argparse.Namespace) -> dict:
    from megatron_patches.parallel import free_port

    world, sequence_parallel = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(run_rank, args=(world, free_port(), args, sequence_parallel, out), nprocs=world, join=True)
        ranks = [torch.load(f"{out}/rank{r}.pt") for r in range(world)]
    return {
        "layout": layout,
        "ranks": world,
        "sequence_parallel": sequence_parallel,
        "saved_mb_per_rank": max(r["saved_bytes"] for r in ranks) / 2**20,
        "step_s": max(r["step_s"] for r in ranks),
        "loss": ranks[0]["loss"],
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the ranks")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.seq_len < 2 or args.steps < 1:
        raise SystemExit("--seq-len must be >= 2 and --steps >= 1")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs two GPUs (one per TP rank)")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    rows = [measure(layout, args) for layout in LAYOUTS]
    base = rows[1]["saved_mb_per_rank"]
    print(f"sequence parallelism, {args.preset}, 1 x {args.seq_len} tokens, fp32, LoRA r8, {args.device}")
    print(f"{'layout':12s} {'saved MB/rank':>14s} {'vs TP=2':>8s} {'step s':>8s} {'loss':>10s}")
    for r in rows:
        print(
            f"{r['layout']:12s} {r['saved_mb_per_rank']:14.1f} {r['saved_mb_per_rank'] / base:7.2f}x "
            f"{r['step_s']:8.3f} {r['loss']:10.5f}"
        )
    result = {
        "rows": rows,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": "python scripts/bench_sequence_parallel.py " + " ".join(argv),
        "env": {
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
