"""Group-normalized advantages: hand-computed values, zero-variance groups, ragged groups, errors."""

import math

import pytest
import torch

from miles_k3.algo import expand_to_tokens, group_advantages

S3 = math.sqrt(3.0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_grpo_hand_computed():
    # group 0: mean 0.25; population var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875, std = sqrt(3)/4
    #   A = 0.75 / (sqrt(3)/4) = sqrt(3),  -0.25 / (sqrt(3)/4) = -1/sqrt(3)
    # group 1: all equal -> exactly 0
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards)
    expected = torch.tensor([[S3, -1 / S3, -1 / S3, -1 / S3], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    assert adv.dtype == torch.float32 and adv.shape == rewards.shape
    assert torch.equal(adv[1], torch.zeros(4))


def test_dr_grpo_no_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]])
    adv = group_advantages(rewards, normalize_std=False)
    # r - mean: group 0 mean 0.25, group 1 mean 5
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25], [-3.0, -1.0, 1.0, 3.0]]))


def test_flat_layout_matches_2d():
    rewards = torch.rand(3, 5)
    flat = group_advantages(rewards.reshape(-1), group_size=5)
    assert flat.shape == (15,)
    torch.testing.assert_close(flat.view(3, 5), group_advantages(rewards))


def test_population_std_two_samples():
    # n = 2, rewards {0, 1}: population std 0.5 -> A = +-1 (Bessel's std 0.707 would give +-0.707)
    adv = group_advantages(torch.tensor([[0.0, 1.0]]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0]]))


def test_unit_rms_invariant():
    # with ddof 0, sum_i A_i^2 = n per group (up to eps), whatever n is
    for n in (2, 3, 8):
        adv = group_advantages(torch.randn(4, n, dtype=torch.float64), eps=0.0)
        torch.testing.assert_close((adv**2).sum(-1), torch.full((4,), float(n), dtype=torch.float64))
        torch.testing.assert_close(adv.sum(-1), torch.zeros(4, dtype=torch.float64))


def test_zero_variance_exact_zero_despite_rounding():
    # fp64: (0.1 + 0.1 + 0.1) / 3 = 0.10000000000000002 != 0.1; (r - mean) / eps would be -1.4e-11 / 1e-6 noise
    r = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert r.mean() != r[0]
    adv = group_advantages(r, group_size=3)
    assert adv.dtype == torch.float64 and torch.equal(adv, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(group_advantages(r, group_size=3, normalize_std=False), torch.zeros(3, dtype=torch.float64))


def test_group_of_one_is_zero():
    assert torch.equal(group_advantages(torch.tensor([[3.0], [5.0]])), torch.zeros(2, 1))


def test_ragged_groups_by_id():
    # group 0: {1, 0}: mean 0.5, std 0.5 -> +-1; group 1: {5, 3}: mean 4, std 1 -> +-1; group 2: {7} -> 0
    rewards = torch.tensor([1.0, 5.0, 0.0, 3.0, 7.0])
    ids = torch.tensor([0, 1, 0, 1, 2])
    adv = group_advantages(rewards, group_ids=ids, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0]))


def test_int_and_bool_rewards_become_fp32():
    adv = group_advantages(torch.tensor([[1, 0], [True, True]]).int())
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0], [0.0, 0.0]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: group_advantages(torch.tensor([1.0, float("nan")]), group_size=2), "NaN or inf"),
        (lambda: group_advantages(torch.tensor([1.0, float("inf")]), group_size=2), "NaN or inf"),
        (lambda: group_advantages(torch.zeros(6), group_size=4), "do not split"),
        (lambda: group_advantages(torch.zeros(6)), "exactly one"),
        (lambda: group_advantages(torch.zeros(6), group_size=3, group_ids=torch.zeros(6)), "exactly one"),
        (lambda: group_advantages(torch.zeros(2, 3), group_size=3), "neither"),
        (lambda: group_advantages(torch.zeros(2, 3, 1)), r"\[G, n\] or \[N\]"),
        (lambda: group_advantages(torch.zeros(4), group_ids=torch.zeros(3)), "must match"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_expand_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = expand_to_tokens(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    per_token = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    torch.testing.assert_close(expand_to_tokens(per_token, mask), torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        expand_to_tokens(torch.zeros(3), mask)


def test_sample_std_advantages_are_ours_times_sqrt_n_minus_1_over_n():
    # TRL / verl divide by the sample std (ddof 1): their advantages are ours scaled by sqrt((n - 1) / n)
    n = 8
    rewards = torch.rand(3, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    theirs = (rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, correction=1, keepdim=True)
    ours = group_advantages(rewards, eps=0.0)
    torch.testing.assert_close(theirs, ours * math.sqrt((n - 1) / n))
