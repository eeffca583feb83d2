"""TIS, MIS, OPSM against the engine's log-probs, and the ESS metric."""

import math

import pytest
import torch

from miles_k3.algo import effective_sample_size, mis_weights, opsm_mask, tis_weights

LN = math.log


def logps(log_ratios):
    """(old_logp, rollout_logp) with old - rollout = the given log ratios."""
    rollout = torch.full((len(log_ratios), len(log_ratios[0])), -1.0)
    return rollout + torch.tensor(log_ratios), rollout


def test_tis_cap_and_detached():
    # ratios 3, 0.5, 1, (masked 100) with C = 2 -> min(w, 2) = 2, 0.5, 1, and 0 off the mask
    old, rollout = logps([[LN(3.0), LN(0.5), 0.0, LN(100.0)]])
    old.requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    w = tis_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert not w.requires_grad
    with pytest.raises(ValueError):
        tis_weights(old, rollout, mask, cap=0.0)


def test_mis_token_level():
    # ratios 3, 0.4, 1.5, 0.5 in [0.5, 2]: reject 3 and 0.4, keep 1.5 and 0.5 (bounds inclusive), weight = ratio
    old, rollout = logps([[LN(3.0), LN(0.4), LN(1.5), LN(0.5)]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    res = mis_weights(old, rollout, mask, 0.5, 2.0, "token")
    assert res.keep.tolist() == [[False, False, True, True]]
    torch.testing.assert_close(res.weight, torch.tensor([[0.0, 0.0, 1.5, 0.5]]))


def test_mis_sequence_and_geometric():
    # row 0: token ratios 2 and 1.5 -> product 3 (> 2: rejected); geometric sqrt(3) = 1.732 (kept)
    # row 1: 1.5 and 1/1.2 -> product 1.25 (kept); geometric sqrt(1.25)
    # row 2: 1.9 and (masked 50) -> 1.9 for both levels (padding ignored)
    old, rollout = logps([[LN(2.0), LN(1.5)], [LN(1.5), LN(1 / 1.2)], [LN(1.9), LN(50.0)]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    seq = mis_weights(old, rollout, mask, 0.5, 2.0, "sequence")
    assert seq.keep.tolist() == [[False, False], [True, True], [True, False]]
    torch.testing.assert_close(seq.weight, torch.tensor([[0.0, 0.0], [1.25, 1.25], [1.9, 0.0]]))
    geo = mis_weights(old, rollout, mask, 0.5, 2.0, "geometric")
    assert geo.keep.tolist() == [[True, True], [True, True], [True, False]]
    torch.testing.assert_close(
        geo.weight, torch.tensor([[math.sqrt(3), math.sqrt(3)], [1.25**0.5, 1.25**0.5], [1.9, 0.0]])
    )


def test_mis_sequence_overflow_is_rejected_not_nan():
    # ten tokens of log ratio 100: the sequence ratio exp(1000) overflows fp32; it must be rejected cleanly
    old, rollout = logps([[100.0] * 10])
    res = mis_weights(old, rollout, torch.ones(1, 10, dtype=torch.bool), 0.0, 2.0, "sequence")
    assert not res.keep.any() and torch.equal(res.weight, torch.zeros(1, 10))


@pytest.mark.parametrize(
    "low, high, level", [(1.5, 2.0, "token"), (0.5, 0.9, "token"), (-0.1, 2.0, "token"), (0.5, 2.0, "chunk")]
)
def test_mis_errors(low, high, level):
    with pytest.raises(ValueError):
        mis_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), low, high, level)


def test_opsm():
    # seq_kl_i = mean_t (rollout_logp - logp) over the mask, delta 0.1
    # row 0: [0.2, 0.4] -> 0.3 > 0.1 and A < 0 -> masked
    # row 1: [0.0, 0.1] -> 0.05 <= 0.1        -> kept
    # row 2: [0.2, 0.4] -> 0.3 but A > 0       -> kept
    # row 3: [-0.2, -0.4] -> -0.3               -> kept
    # row 4: [0.5, (masked 9)] -> 0.5, A < 0   -> masked (padding ignored)
    logp = torch.full((5, 2), -2.0, requires_grad=True)
    rollout = logp.detach() + torch.tensor([[0.2, 0.4], [0.0, 0.1], [0.2, 0.4], [-0.2, -0.4], [0.5, 9.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, -0.5])
    res = opsm_mask(logp, rollout, adv, mask, delta=0.1)
    torch.testing.assert_close(res.seq_kl, torch.tensor([0.3, 0.05, 0.3, -0.3, 0.5]))
    assert res.keep.tolist() == [[False, False], [True, True], [True, True], [True, True], [False, False]]
    assert not res.keep.requires_grad and not res.seq_kl.requires_grad


def test_opsm_token_level_advantages():
    # per-token advantages: only the A_t < 0 tokens of a high-KL sequence are masked (M_i,t in the paper)
    logp = torch.zeros(1, 3)
    rollout = torch.full((1, 3), 0.5)
    res = opsm_mask(logp, rollout, torch.tensor([[1.0, -1.0, 0.0]]), torch.ones(1, 3), delta=0.1)
    assert res.keep.tolist() == [[True, False, True]]


def test_ess():
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    # uniform weights -> 1, whatever their scale; padding (inf) ignored
    torch.testing.assert_close(
        effective_sample_size(torch.tensor([[3.0, 3.0, 3.0, 3.0, math.inf]]), mask), torch.tensor(1.0)
    )
    # one-hot over n = 4 -> (1)^2 / (4 * 1) = 0.25
    torch.testing.assert_close(
        effective_sample_size(torch.tensor([[0.0, 5.0, 0.0, 0.0, 1.0]]), mask), torch.tensor(0.25)
    )
    # [1, 3]: (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20 = 0.8
    torch.testing.assert_close(effective_sample_size(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2)), torch.tensor(0.8))
    # nothing valid -> 0 (not NaN)
    assert effective_sample_size(torch.ones(1, 2), torch.zeros(1, 2)).item() == 0.0
