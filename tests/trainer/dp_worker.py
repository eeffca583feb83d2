"""A trainer rank built as `miles-train` builds it (the recipe composed, `start_trainer_rank`), training once on
a fixed batch: the world of tests/trainer/test_data_share.py."""

from __future__ import annotations

import torch

from megatron_patches.parallel import end_world
from miles_k3.trainer.batch import TrainBatch


def one_group() -> TrainBatch:
    """Two samples of one group: fewer groups than data-parallel ranks."""
    prompts = [[1, 5, 7, 9], [1, 5, 7, 9]]
    responses = [[4, 9, 17, 2], [5, 8, 2]]
    logps = [[-1.0] * len(r) for r in responses]
    return TrainBatch.of(prompts, responses, logps, [1.0, -1.0], [0, 0])


def worker(rank: int, world: int, port: int, out: str, overrides: tuple[str, ...]) -> None:
    from miles_k3.trainer.resolve import resolve
    from miles_k3.trainer.workers import configure_process, start_trainer_rank
    from tests.trainer.recipes import composed

    rc = resolve(composed(*overrides, f"cluster.num_workers={world}"))
    configure_process(rc, rank)
    try:
        _, _, trainer = start_trainer_rank(rc, rank, "cpu", f"tcp://127.0.0.1:{port}")
        metrics = trainer.train(one_group())
        torch.save({k: float(v) for k, v in metrics.items()}, f"{out}/rank{rank}.pt")
    finally:
        end_world()
