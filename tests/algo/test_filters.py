"""DAPO dynamic sampling: zero-variance groups are dropped; refill count."""

import pytest
import torch

from miles_k3.algo import group_advantages, groups_to_refill, nonzero_variance_groups


def test_keep_mask():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.2, 0.3, 0.2]])
    keep = nonzero_variance_groups(rewards)
    assert keep.tolist() == [False, True, False, False, True]
    assert torch.equal(nonzero_variance_groups(rewards.reshape(-1), group_size=3), keep)
    # the dropped groups are exactly the ones whose advantages are all 0
    assert torch.equal(group_advantages(rewards).abs().amax(-1) > 0, keep)


def test_ragged_ids():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0])
    ids = torch.tensor([0, 0, 1, 1, 2])  # group 2 has a single sample: no variance
    keep = nonzero_variance_groups(rewards, group_ids=ids)
    assert keep.tolist() == [False, True, False]
    assert keep[ids].tolist() == [False, False, True, True, False]


def test_nan_reward_is_an_error():
    with pytest.raises(ValueError, match="NaN"):
        nonzero_variance_groups(torch.tensor([[1.0, float("nan")]]))


def test_groups_to_refill():
    assert groups_to_refill(3, 8) == 5  # shortfall
    assert groups_to_refill(8, 8) == 0 and groups_to_refill(10, 8) == 0
    assert groups_to_refill(3, 8, keep_rate=0.5) == 10  # 5 / 0.5
    assert groups_to_refill(5, 8, keep_rate=0.3) == 10  # 3 / 0.3 = 10.000000000000002 -> 10
    assert groups_to_refill(6, 8, keep_rate=0.3) == 7  # 2 / 0.3 = 6.67 -> 7
    for kw in (dict(keep_rate=0.0), dict(keep_rate=1.5)):
        with pytest.raises(ValueError, match="keep_rate"):
            groups_to_refill(1, 8, **kw)
    with pytest.raises(ValueError):
        groups_to_refill(-1, 8)
