"""One rank of a colocated world built as `miles-train` builds it (the recipe composed, `start_trainer_rank`,
`build_rollout_worker` with the engine's own layout), a random adapter loaded into the trainer's shards, then
synced shard to shard into the engine shards: the world of tests/trainer/test_adapter_sync.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_patches.parallel import end_world


def exact(pool, adapter: dict[str, torch.Tensor], slot: int) -> bool:
    """Whether every tensor of `pool`'s slot is its box of the full `adapter`, bit for bit."""
    from miles_k3.trainer.adapter_sync import region

    for key, (full, box) in pool.local_boxes().items():
        module, _, factor = key.rpartition(".")
        got = (pool.A if factor == "lora_A" else pool.B)[module][slot]
        want = region(adapter[key], box, tuple((0, n) for n in full)).to(pool.dtype)
        if not torch.equal(got, want):
            return False
    return True


def worker(rank: int, world: int, port: int, out: str, overrides: tuple[str, ...]) -> None:
    from megatron_patches.lora import load_adapter_state
    from miles_k3.model import checkpoint
    from miles_k3.trainer.backends import ColocatedRank
    from miles_k3.trainer.resolve import resolve
    from miles_k3.trainer.rollout_plugin import ADAPTER
    from miles_k3.trainer.workers import build_rollout_worker, configure_process, start_trainer_rank
    from tests.trainer.recipes import composed

    read = [0]  # checkpoint bytes this rank reads, trainer and engine shard together
    stored = checkpoint.CheckpointSource._stored

    def counted(self, name, index):
        t = stored(self, name, index)
        read[0] += t.numel() * t.element_size()
        return t

    checkpoint.CheckpointSource._stored = counted
    rc = resolve(composed(*overrides, f"cluster.num_workers={world}"))
    configure_process(rc, rank)
    try:
        config, state, trainer = start_trainer_rank(
            rc, rank, "cpu", f"tcp://127.0.0.1:{port}", whole=rc.rollout.tp == 1
        )
        engine = build_rollout_worker(rc, config, state, "cpu")
        g = torch.Generator().manual_seed(3)  # the same full adapter on every rank; each loads its own slices
        adapter = {
            k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sorted(trainer.adapter_state().items())
        }
        load_adapter_state(trainer.policy, adapter)
        target = ColocatedRank(trainer, engine, rank, world, rc.rollout.tp)
        stats = target.sync_adapter()  # loads the slot
        pool = engine.engine.adapters
        slot = pool.slot_of(ADAPTER)
        first = exact(pool, adapter, slot)
        adapter = {k: v * 2 for k, v in adapter.items()}  # an update of every value, into the same slot
        load_adapter_state(trainer.policy, adapter)
        blocks, sent, received = target._sync.run(trainer.adapter_shards())
        engine.engine.set_adapter_shards(ADAPTER, blocks)
        updated = exact(pool, adapter, slot) and pool.slot_of(ADAPTER) == slot
        # a checkpoint's gather: the whole adapter on rank 0, one layer's part at a time
        parts = [target.adapter_part(i) for i in range(target.adapter_part_count())]
        gathered = {k: v for part in parts if part is not None for k, v in part.items()}
        if rank == 0:
            whole = sorted(gathered) == sorted(adapter) and all(torch.equal(gathered[k], adapter[k]) for k in adapter)
            largest = max(sum(v.numel() for v in part.values()) for part in parts)
            whole = whole and largest < sum(v.numel() for v in adapter.values())
        else:
            whole = not gathered
        # the check can fail: every engine rank takes its neighbour's blocks where they are other blocks of the
        # same shapes (an engine TP / EP layout; replicas of one rank all hold the same whole tensors)
        every = [None] * world
        dist.all_gather_object(every, (blocks, pool.local_boxes()))
        other, boxes = every[(rank + 1) % world]
        swapped = None
        if boxes != pool.local_boxes() and all(other[k].shape == v.shape for k, v in blocks.items()):
            engine.engine.set_adapter_shards(ADAPTER, other)
            swapped = exact(pool, adapter, slot)
        torch.save(
            {
                "first": first,
                "gathered": whole,
                "updated": updated,
                "swapped": swapped,
                "stats": stats,
                "sent": sent,
                "received": received,
                "engine_bytes": sum(b.numel() * b.element_size() for b in blocks.values()),
                "adapter_bytes": sum(
                    v.numel() * torch.empty(0, dtype=pool.dtype).element_size() for v in adapter.values()
                ),
                "read": read[0],
            },
            f"{out}/rank{rank}.pt",
        )
    finally:
        end_world()
