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


def routed_groups(config) -> TrainBatch:
    """Four samples of two groups, each token's experts drawn at random (seeded: the same on every rank), the
    last token of each sample unrecorded: a routing no router of the model would choose, so a layout that
    hands a MoE layer another token's or another layer's row changes the result."""
    from miles_k3.model.routing import moe_layers

    g = torch.Generator().manual_seed(7)
    prompts = [[1, 5, 7, 9, 11], [1, 5, 7, 9, 11], [1, 12, 3], [1, 12, 3]]
    responses = [[4, 9, 17, 2], [5, 8, 2], [6, 6, 21, 13, 2], [2]]
    batch = TrainBatch.of(
        prompts, responses, [[-1.0] * len(r) for r in responses], [1.0, -1.0, 0.5, -0.5], [0, 0, 1, 1]
    )
    for s in batch.samples:
        n = len(s.prompt_ids) + len(s.output_ids)
        scores = torch.rand(n, len(moe_layers(config)), config.num_experts, generator=g)
        s.routed_experts = scores.topk(config.num_experts_per_token, dim=-1).indices.to(torch.int16)
        s.routed_experts[-1] = -1
    return batch


def worker(rank: int, world: int, port: int, out: str, overrides: tuple[str, ...], routed: bool = False) -> None:
    from miles_k3.trainer.resolve import resolve
    from miles_k3.trainer.workers import configure_process, start_trainer_rank
    from tests.trainer.recipes import composed

    rc = resolve(composed(*overrides, f"cluster.num_workers={world}"))
    configure_process(rc, rank)
    try:
        config, _, trainer = start_trainer_rank(rc, rank, "cpu", f"tcp://127.0.0.1:{port}")
        metrics = trainer.train(routed_groups(config) if routed else one_group())
        torch.save({k: float(v) for k, v in metrics.items()}, f"{out}/rank{rank}.pt")
    finally:
        end_world()
