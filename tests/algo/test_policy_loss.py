"""Clipped surrogate (clip-higher, dual-clip) and token / GSPO ratios: values and gradients."""

import math

import pytest
import torch

from miles_k3.algo import clipped_surrogate, gspo_log_ratio, sequence_mean, token_log_ratio

LN = math.log


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def surrogate(ratios, advantages, eps_low=0.2, eps_high=0.2, c=None):
    log_ratio = torch.tensor([LN(r) for r in ratios], requires_grad=True)
    out = clipped_surrogate(log_ratio, torch.tensor(advantages), eps_low, eps_high, c)
    out.loss.sum().backward()
    return out, log_ratio.grad


def test_clip_hand_computed():
    # token 0: r 1.5, A +1: L1 = -1.5, L2 = -clip(1.5, 0.8, 1.2) = -1.2 -> max -1.2, clipped (high side)
    # token 1: r 0.5, A -1: L1 = 0.5,  L2 = 0.8                      -> 0.8, clipped (low side)
    # token 2: r 0.5, A +1: L1 = -0.5, L2 = -0.8                     -> -0.5, not clipped
    # token 3: r 1.5, A -1: L1 = 1.5,  L2 = 1.2                      -> 1.5, not clipped
    # token 4: r 1.1, A +2: inside [0.8, 1.2]                        -> -2.2, not clipped
    out, grad = surrogate([1.5, 0.5, 0.5, 1.5, 1.1], [1.0, -1.0, 1.0, -1.0, 2.0])
    torch.testing.assert_close(out.loss, torch.tensor([-1.2, 0.8, -0.5, 1.5, -2.2]))
    assert out.clipped.tolist() == [True, True, False, False, False]
    assert not out.dual_clipped.any()
    # d/dlog r of -A r is -A r where unclipped, 0 where the clip binds
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -0.5, 1.5, -2.2]))


def test_clip_higher_separate_eps():
    # eps_low 0.2, eps_high 0.28 (DAPO): r 1.25, A +1 now inside (1.25 < 1.28) -> -1.25, gradient flows;
    # r 1.5 -> -1.28 clipped; r 0.75, A -1 -> L2 = 0.8 > 0.75 -> clipped at the (unchanged) floor 0.8
    out, grad = surrogate([1.25, 1.5, 0.75], [1.0, 1.0, -1.0], eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor([-1.25, -1.28, 0.8]))
    assert out.clipped.tolist() == [False, True, True]
    torch.testing.assert_close(grad, torch.tensor([-1.25, 0.0, 0.0]))


def test_dual_clip_bound():
    # c = 3, A = -1: r 5 -> PPO loss max(5, 1.2) = 5 > 3 = -c A -> 3, dual-clipped, gradient 0
    #                r 2 -> 2 < 3 -> 2, gradient -A r = 2
    # A = +1, r 5: dual-clip does not apply -> max(-5, -1.2) = -1.2 (ordinary clip)
    out, grad = surrogate([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], c=3.0)
    torch.testing.assert_close(out.loss, torch.tensor([3.0, 2.0, -1.2]))
    assert out.dual_clipped.tolist() == [True, False, False]
    assert out.clipped.tolist() == [False, False, True]
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0, 0.0]))


def test_dual_clip_scales_with_advantage():
    # A = -0.5, r 10, c 3: bound -c A = 1.5 < -A r = 5
    out, _ = surrogate([10.0], [-0.5], c=3.0)
    torch.testing.assert_close(out.loss, torch.tensor([1.5]))


@pytest.mark.parametrize(
    "kw",
    [
        dict(eps_low=1.0, eps_high=0.2),
        dict(eps_low=-0.1, eps_high=0.2),
        dict(eps_low=0.2, eps_high=-0.1),
        dict(eps_low=0.2, eps_high=0.2, dual_clip_c=1.0),
    ],
)
def test_surrogate_rejects_bad_args(kw):
    with pytest.raises(ValueError):
        clipped_surrogate(torch.zeros(2), torch.ones(2), **kw)


def test_token_log_ratio_detaches_old():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.5, -2.0], requires_grad=True)
    token_log_ratio(logp, old).sum().backward()
    assert old.grad is None
    torch.testing.assert_close(logp.grad, torch.ones(2))


def test_gspo_ratio_value():
    # row 0: logp - old = [0.1, 0.3, (masked 5.0)] -> log s = 0.2; row 1: [-0.4] -> -0.4; row 2 empty -> 0
    logp = torch.tensor([[-1.0, -2.0, 3.0], [-0.9, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = logp - torch.tensor([[0.1, 0.3, 5.0], [-0.4, 7.0, 7.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    log_s = gspo_log_ratio(logp, old, mask)
    torch.testing.assert_close(log_s[0, :2], torch.tensor([0.2, 0.2]))
    torch.testing.assert_close(log_s[1, 0], torch.tensor(-0.4))
    torch.testing.assert_close(log_s[2], torch.zeros(3))


def test_gspo_token_gradient_is_sequence_ratio_times_logp_gradient():
    # A tiny "policy": logp_t = log_softmax(W h_t)[y_t]. GSPO-token: d/dW sum_t -A_i s_i,t
    # must equal sum_t -A_i * s_i * d logp_t / dW with s_i a constant (the stop-gradient form).
    B, T, D, V = 3, 5, 4, 6
    W = torch.randn(V, D, requires_grad=True)
    h, y = torch.randn(B, T, D), torch.randint(0, V, (B, T))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None]

    def logp_of(W):
        return torch.log_softmax(h @ W.T, -1).gather(-1, y[..., None]).squeeze(-1)

    old = (logp_of(W) + 0.1 * torch.randn(B, T)).detach()
    logp = logp_of(W)
    log_ratio = gspo_log_ratio(logp, old, mask)
    ratio = torch.exp(log_ratio)
    (grad_token_form,) = torch.autograd.grad((-adv * ratio)[mask].sum(), W)

    s = torch.exp(((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).detach()
    # value: every valid token's ratio equals its sequence ratio s_i
    torch.testing.assert_close(ratio, s.expand(B, T))
    (grad_expected,) = torch.autograd.grad((-adv * s * logp_of(W))[mask].sum(), W)
    torch.testing.assert_close(grad_token_form, grad_expected)


def test_gspo_token_with_sequence_mean_equals_sequence_level_gspo():
    # GSPO (sequence level): J = mean_i -A_i s_i(theta), s_i = exp(mean_t(logp - old)), fully differentiable.
    # GSPO-token + sequence_mean reducer + sequence-constant A has the same gradient (arXiv 2507.18071).
    B, T = 4, 6
    logp_a = (-torch.rand(B, T)).requires_grad_()
    old = logp_a.detach() + 0.05 * torch.randn(B, T)
    mask = torch.rand(B, T) > 0.3
    mask[:, 0] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])

    tok = clipped_surrogate(gspo_log_ratio(logp_a, old, mask), adv[:, None].expand(B, T), 0.2, 0.2)
    assert not tok.clipped.any()  # |log s| <= 0.05 * few: inside [0.8, 1.2]
    (g_token,) = torch.autograd.grad(sequence_mean(tok.loss, mask), logp_a)

    logp_b = logp_a.detach().clone().requires_grad_()
    s = torch.exp(torch.where(mask, logp_b - old, 0.0).sum(-1) / mask.sum(-1))
    (g_seq,) = torch.autograd.grad((-adv * s).mean(), logp_b)
    torch.testing.assert_close(g_token, g_seq)


def test_gspo_clip_is_per_sequence():
    # log s = 0.5 for the row (s = 1.6487 > 1 + 4e-4), A +1: every valid token is clipped, zero gradient
    logp = torch.tensor([[0.2, 0.8]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = clipped_surrogate(gspo_log_ratio(logp, old, mask), torch.ones(1, 2), 3e-4, 4e-4)
    assert out.clipped.all()
    torch.testing.assert_close(out.loss, torch.full((1, 2), -(1 + 4e-4)))
    out.loss.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
