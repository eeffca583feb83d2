"""Metric helpers: clipfrac, approx KL, chunked entropy, log-prob abs diff, reward stats."""

import math

import pytest
import torch

from miles_k3.algo import approx_kl, entropy_from_logits, logprob_abs_diff, pg_clipfrac, reward_stats


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_pg_clipfrac():
    clipped = torch.tensor([[True, False, True, True], [False, False, False, True]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    # valid: T F T | F F -> 2 / 5
    torch.testing.assert_close(pg_clipfrac(clipped, mask), torch.tensor(0.4))


def test_approx_kl_k3_old_vs_current():
    # logp - old = ln 2 -> r = 2 -> (r - 1) - ln r = 1 - 0.6931 = 0.3068528; second row r = 1/2 -> 0.5 - 1 + ln 2
    logp = torch.tensor([[math.log(0.5)], [math.log(0.25)], [float("nan")]], requires_grad=True)
    old = torch.tensor([[math.log(0.25)], [math.log(0.5)], [0.0]])
    mask = torch.tensor([[1], [1], [0]], dtype=torch.bool)
    expected = ((1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2
    kl = approx_kl(logp, old, mask)
    torch.testing.assert_close(kl, torch.tensor(expected))
    assert not kl.requires_grad
    assert approx_kl(old, old, torch.ones(3, 1)).item() == 0.0


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_entropy_matches_categorical(chunk):
    logits = 3 * torch.randn(2, 5, 7)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk), ref)


def test_entropy_hand_values_and_edge_cases():
    # uniform over 5 -> ln 5; two finite logits and two -inf (masked vocab) -> ln 2, in any chunking
    torch.testing.assert_close(entropy_from_logits(torch.zeros(1, 1, 5), chunk_size=2), torch.tensor([[math.log(5)]]))
    masked = torch.tensor([[[-math.inf, 0.0, -math.inf, 0.0]]])
    for chunk in (1, 2, 4):
        torch.testing.assert_close(entropy_from_logits(masked, chunk_size=chunk), torch.tensor([[math.log(2)]]))
    # huge logits: the online max keeps it stable (one-hot -> 0 entropy)
    big = torch.tensor([[[1e4, 0.0, -1e4]]])
    assert entropy_from_logits(big, chunk_size=1).abs().item() < 1e-6


def test_entropy_bf16_input_fp32_output():
    logits = torch.randn(2, 3, 11).bfloat16()
    out = entropy_from_logits(logits, chunk_size=4)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    torch.testing.assert_close(out, torch.distributions.Categorical(logits=logits.float()).entropy())


def test_logprob_abs_diff():
    a = torch.tensor([[-1.0, -2.0, 5.0]])
    b = torch.tensor([[-1.5, -1.0, float("nan")]])
    # (0.5 + 1.0) / 2, padding ignored
    torch.testing.assert_close(logprob_abs_diff(a, b, torch.tensor([[1, 1, 0]])), torch.tensor(0.75))


def test_reward_stats():
    stats = reward_stats(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    # mean 0.25, population std sqrt(0.1875) = 0.4330127
    torch.testing.assert_close(stats["reward_mean"], torch.tensor(0.25))
    torch.testing.assert_close(stats["reward_std"], torch.tensor(math.sqrt(0.1875)))


def test_reward_stats_keeps_fp64_and_is_nan_when_empty():
    stats = reward_stats(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert stats["reward_mean"].dtype == torch.float64 and float(stats["reward_std"]) == math.sqrt(0.1875)
    assert all(math.isnan(float(v)) for v in reward_stats(torch.tensor([])).values())
