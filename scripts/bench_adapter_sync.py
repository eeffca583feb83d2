"""Bytes each rank sends and receives per step when the adapter moves shard to shard from the trainer's layout
to the engine's (`miles_k3.trainer.adapter_sync`), against the old way (the whole adapter gathered onto every
rank, then each engine rank keeping its slices), for a model and a GPU count, with no GPU and no process:

    python scripts/bench_adapter_sync.py --preset k3 --gpus 64 --layout tp=1,pp=16,cp=4,ep=4 \\
        --engine-layout tp=16,ep=1 --engine-layout tp=16,ep=0 --json sync.json

Every rank of the trainer layout is built on the meta device in a fake world of the layout's size
(`megatron_patches.layout_plan.fake_rank`) and reports its blocks (`megatron_patches.lora.adapter_shards`);
every engine rank is built on the meta device too (`rollout.shard_plan.meta_shard`, its pool's `local_boxes`).
The sync's own plan (`adapter_sync.plan`) then gives each rank's pieces. Bytes are in the engine's adapter
dtype (bf16). The same plan runs in `miles-train`, which logs the step's `adapter_sync_sent_bytes_max` /
`adapter_sync_received_bytes_max`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

GiB = 2**30


def trainer_boxes(config, lora, layout, dtype) -> list[dict]:
    """Each trainer rank's blocks, rank by rank (one meta build per rank)."""
    from megatron.core import parallel_state as ps

    from megatron_patches.layout_plan import _build, fake_rank
    from megatron_patches.lora import adapter_shards

    out = []
    for rank in range(layout.world):
        with fake_rank(layout, rank):
            model = _build(config, lora, layout, ps.get_pipeline_model_parallel_rank(), dtype, None)
            out.append({name: box for name, (_, box) in adapter_shards(model).items()})
    return out


def engine_boxes(config, lora, layout, world: int, quantize: str, dtype) -> list[dict]:
    """Each rank's engine blocks: replicas of `layout.tp` consecutive ranks, one meta build per replica rank."""
    from rollout.shard_plan import meta_shard

    per_rank = []
    for r in range(layout.tp):
        _, pool = meta_shard(config, layout, r, quantize=quantize, lora=lora, dtype=dtype)
        per_rank.append({name: box for name, (_, box) in pool.local_boxes().items()})
    return [per_rank[rank % layout.tp] for rank in range(world)]


def measure(config, lora, layout, engine_layout, quantize: str, held: list[dict] | None = None) -> dict:
    from miles_k3.trainer.adapter_sync import plan, volume

    dtype = torch.bfloat16
    start = time.perf_counter()
    held = held if held is not None else trainer_boxes(config, lora, layout, dtype)
    needed = engine_boxes(config, lora, engine_layout, layout.world, quantize, dtype)
    pieces = plan(held, needed)
    sent, received = [0] * layout.world, [0] * layout.world
    for p in pieces:
        if p.src != p.dst:
            sent[p.src] += volume(p.box) * 2
            received[p.dst] += volume(p.box) * 2
    adapter = _adapter_bytes(held)
    mine = [sum(volume(b) for b in h.values()) * 2 for h in held]
    engine = [sum(volume(b) for b in n.values()) * 2 for n in needed]
    return {
        "trainer_layout": str(layout),
        "engine_layout": str(engine_layout),
        "adapter_gib": adapter / GiB,
        "trainer_block_gib_max": max(mine) / GiB,
        "engine_block_gib_max": max(engine) / GiB,
        "sent_gib_max": max(sent) / GiB,
        "received_gib_max": max(received) / GiB,
        "sent_gib_total": sum(sent) / GiB,
        # the old way: every rank gathers the whole adapter (all-gathers over TP / EP / PP: it receives all but
        # its own blocks)
        "gather_received_gib_max": max(adapter - m for m in mine) / GiB,
        "pieces": len(pieces),
        "seconds": time.perf_counter() - start,
    }


def _adapter_bytes(held: list[dict]) -> int:
    """The whole adapter in bf16: each tensor the union of its distinct trainer boxes (they tile it)."""
    from miles_k3.trainer.adapter_sync import volume

    sizes: dict[str, set] = {}
    for h in held:
        for name, box in h.items():
            sizes.setdefault(name, set()).add(box)
    return sum(volume(b) for boxes in sizes.values() for b in boxes) * 2


def main(argv: list[str] | None = None) -> list[dict]:
    from megatron_patches.layout_plan import Layout
    from miles_k3.model.config import K3Config
    from miles_k3.model.lora_spec import LoraSpec
    from rollout.shard_plan import EngineLayout

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--layout", default="tp=1,pp=16,cp=4,ep=4", help="the trainer's tp=,pp=,cp=,ep=[,dp=]")
    p.add_argument("--engine-layout", action="append", default=None, help="tp=,dcp=,ep= (repeatable)")
    p.add_argument("--quantize", default="all")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--json")
    args = p.parse_args(argv)
    config = K3Config.from_preset(args.preset)
    lora = LoraSpec(rank=args.lora_rank)
    layout = Layout.parse(args.layout, args.gpus)
    held = trainer_boxes(config, lora, layout, torch.bfloat16)
    rows = [
        measure(config, lora, layout, EngineLayout.parse(e), args.quantize, held)
        for e in (args.engine_layout or ["tp=16,ep=1"])
    ]
    print(
        f"{'trainer':28} {'engine':18} {'adapter':>8} {'own max':>8} {'engine max':>10} {'sent max':>9} "
        f"{'recv max':>9} {'gather':>8}   GiB per rank per step ({args.preset}, rank {args.lora_rank}, bf16)"
    )
    for r in rows:
        print(
            f"{r['trainer_layout']:28} {r['engine_layout']:18} {r['adapter_gib']:8.2f} "
            f"{r['trainer_block_gib_max']:8.2f} {r['engine_block_gib_max']:10.2f} {r['sent_gib_max']:9.2f} "
            f"{r['received_gib_max']:9.2f} {r['gather_received_gib_max']:8.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
