"""Packing rollouts for one varlen forward: positions predict exactly the response tokens."""

import torch

from miles_k3.trainer.batch import TrainBatch, pack


def test_pack_positions_targets_and_padding():
    b = TrainBatch.of(
        prompts=[[1, 5, 6], [1, 7]],
        responses=[[8, 2], [9, 10, 2]],
        rollout_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]],
        advantages=[1.0, -1.0],
        group_ids=[0, 0],
    )
    p = pack(b, "cpu")
    assert p.input_ids.tolist() == [[1, 5, 6, 8, 2, 1, 7, 9, 10, 2]]
    assert p.cu_seqlens.tolist() == [0, 5, 10]
    ids = p.input_ids[0]
    # the token after each predicting position is the target
    assert ids[p.positions + 1].tolist() == p.targets.tolist() == [8, 2, 9, 10, 2]
    assert p.shape == (2, 3)
    assert p.mask().tolist() == [[True, True, False], [True, True, True]]
    flat = torch.tensor([x for lp in b.rollout_logprobs for x in lp], dtype=torch.float64)
    assert p.to_padded(flat).tolist() == [[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]


def test_split_by_groups_keeps_groups_whole():
    b = TrainBatch.of(
        prompts=[[1]] * 6,
        responses=[[2]] * 6,
        rollout_logprobs=[[0.0]] * 6,
        advantages=[0.0] * 6,
        group_ids=[0, 0, 1, 1, 2, 2],
    )
    parts = b.split_by_groups(2)
    assert [p.group_ids for p in parts] == [[0, 0, 2, 2], [1, 1]]
    assert sum(len(p) for p in parts) == 6
