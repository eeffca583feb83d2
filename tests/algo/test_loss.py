"""The composed policy_loss and PolicyLossConfig: validation, hand values, invariants, gradients."""

import dataclasses
import math

import pytest
import torch

from miles_k3.algo import PolicyLossConfig, group_advantages, kl_penalty, policy_loss, reduce_loss

LN = math.log
# PPO's symmetric clip without a rollout correction: the hand-computed cases below need no engine log-probs
PLAIN = PolicyLossConfig(eps_high=0.2, rollout_correction="none")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_low=float("nan")), "eps_low"),
        (dict(eps_high=-0.2), "eps_high"),
        (dict(eps_high="0.2"), "eps_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(dual_clip_c=float("inf")), "dual_clip_c"),
        (dict(ratio="sequence"), "ratio"),
        (dict(kl="k4"), "kl"),
        (dict(kl="k3", kl_coef=-0.1), "kl_coef"),
        (dict(kl="none", kl_coef=0.1), "kl_coef"),
        (dict(reducer="mean"), "reducer"),
        (dict(reducer="dr_grpo"), "max_response_len"),
        (dict(max_response_len=0), "max_response_len"),
        (dict(max_response_len=2.5), "max_response_len"),
        (dict(rollout_correction="tis+mis"), "rollout_correction"),
        (dict(rollout_correction="is"), "rollout_correction"),
        (dict(tis_cap=0.0), "tis_cap"),
        (dict(mis_low=1.5), "mis_low"),
        (dict(mis_high=0.9), "mis_high"),
        (dict(mis_level="chunk"), "mis_level"),
        (dict(opsm_delta=-1e-4), "opsm_delta"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"PolicyLossConfig\.{field}\b"):
        PolicyLossConfig(**kwargs)


def test_defaults_are_the_grpo_run():
    # the trainer's algo.* takes these defaults unchanged (recipes/algo/grpo.yaml sets nothing)
    cfg = PolicyLossConfig()
    assert (cfg.eps_low, cfg.eps_high, cfg.ratio, cfg.reducer, cfg.kl) == (0.2, 0.28, "token", "token_mean", "none")
    assert cfg.corrections == {"tis"} and cfg.tis_cap == 2.0


def test_config_frozen_and_corrections():
    cfg = PolicyLossConfig(
        rollout_correction="tis+opsm",
        reducer="dr_grpo",
        max_response_len=16,
        kl="k3",
        kl_coef=0.01,
        dual_clip_c=3.0,
        eps_high=0.28,
    )
    assert cfg.corrections == {"tis", "opsm"}
    assert PLAIN.corrections == frozenset()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eps_low = 0.1


# ---------------------------------------------------------------- hand-computed values


def test_hand_computed_token_mean():
    # one sequence, ratios [1.5, 1.0, (pad)], A = +1, eps 0.2: per-token [-1.2, -1.0] -> token mean -1.1
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    logp = (old + torch.tensor([[LN(1.5), 0.0, 0.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), mask, PLAIN)
    torch.testing.assert_close(loss, torch.tensor(-1.1))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(1.25))
    # approx_kl: r = 1.5 -> 0.5 - ln 1.5 = 0.0945349; r = 1 -> 0; mean 0.0472674
    torch.testing.assert_close(m["approx_kl"], torch.tensor((0.5 - LN(1.5)) / 2))
    loss.backward()
    # clipped token: 0; unclipped: d/dlogp of -A r / 2 tokens = -1 * 1 / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 0.0]]))


def test_hand_computed_kl_term():
    # ratios 1 (no clip), A = 0 -> pg 0; d = logp - ref = ln 2 on both tokens, k2 = ln2^2 / 2, coef 0.1
    logp = torch.full((1, 2), LN(0.5))
    ref = torch.full((1, 2), LN(0.25))
    cfg = dataclasses.replace(PLAIN, kl="k2", kl_coef=0.1)
    loss, m = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), cfg, ref_logp=ref)
    torch.testing.assert_close(m["kl_loss"], torch.tensor(LN(2) ** 2 / 2))
    torch.testing.assert_close(loss, torch.tensor(0.1 * LN(2) ** 2 / 2))


def test_dual_clip_through_config():
    # r = 5, A = -1, c = 3: 3 instead of 5
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), LN(5.0))
    loss, m = policy_loss(
        logp, old, torch.tensor([-1.0]), torch.ones(1, 1), dataclasses.replace(PLAIN, dual_clip_c=3.0)
    )
    torch.testing.assert_close(loss, torch.tensor(3.0))
    torch.testing.assert_close(m["dual_clipfrac"], torch.tensor(1.0))


# ---------------------------------------------------------------- invariants


@pytest.mark.parametrize("reducer", ["token_mean", "sequence_mean", "dr_grpo"])
@pytest.mark.parametrize("ratio", ["token", "gspo"])
def test_ratio_one_equals_reinforce_with_baseline(reducer, ratio):
    # With logp == old_logp (ratio 1, inside any clip range) the PPO/GSPO loss has the value -reduce(A)
    # and the gradient of REINFORCE with a group-mean baseline: -reduce(A * logp).
    B, T, n = 6, 5, 3
    logp = (-torch.rand(B, T)).requires_grad_()
    mask = torch.rand(B, T) > 0.3
    mask[:, 0] = True
    adv = group_advantages(torch.rand(B), group_size=n, normalize_std=False)  # r - mean_group: the baseline
    cfg = PolicyLossConfig(reducer=reducer, ratio=ratio, max_response_len=T, rollout_correction="none")
    loss, m = policy_loss(logp, logp.detach(), adv, mask, cfg)
    assert m["pg_clipfrac"].item() == 0.0
    adv_t = adv[:, None].expand(B, T)
    torch.testing.assert_close(loss, reduce_loss(-adv_t, mask, reducer, max_response_len=T))
    (g_ppo,) = torch.autograd.grad(loss, logp)
    (g_reinforce,) = torch.autograd.grad(reduce_loss(-adv_t * logp, mask, reducer, max_response_len=T), logp)
    torch.testing.assert_close(g_ppo, g_reinforce)


def test_nan_padding_does_not_leak():
    B, T = 3, 4
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    base = -torch.rand(B, T)
    old, ref, rollout = base + 0.1, base - 0.2, base + 0.05
    cfg = PolicyLossConfig(kl="k3", kl_coef=0.1, rollout_correction="mis+opsm", mis_level="geometric", ratio="gspo")
    clean = base.clone().requires_grad_()
    loss_clean, _ = policy_loss(
        clean, old, torch.tensor([1.0, -1.0, 0.5]), mask, cfg, ref_logp=ref, rollout_logp=rollout
    )
    loss_clean.backward()
    dirty = torch.where(mask, base, float("nan")).requires_grad_()
    junk = lambda x: torch.where(mask, x, float("inf"))  # noqa: E731
    loss_dirty, metrics = policy_loss(
        dirty, junk(old), torch.tensor([1.0, -1.0, 0.5]), mask, cfg, ref_logp=junk(ref), rollout_logp=junk(rollout)
    )
    loss_dirty.backward()
    torch.testing.assert_close(loss_dirty, loss_clean)
    torch.testing.assert_close(dirty.grad, clean.grad)
    assert all(torch.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------- rollout correction in the loss


def test_tis_weight_is_detached_and_scales_gradient():
    B, T = 2, 3
    logp = (-torch.rand(B, T)).requires_grad_()
    old = logp.detach().clone()
    rollout = (old - torch.tensor([[LN(3.0), LN(0.5), 0.0], [LN(1.5), LN(2.5), LN(0.25)]])).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss_tis, m = policy_loss(
        logp, old, adv, mask, dataclasses.replace(PLAIN, rollout_correction="tis"), rollout_logp=rollout
    )
    (g_tis,) = torch.autograd.grad(loss_tis, logp)
    loss_plain, _ = policy_loss(logp, old, adv, mask, PLAIN)
    (g_plain,) = torch.autograd.grad(loss_plain, logp)
    w = torch.tensor([[2.0, 0.5, 1.0], [1.5, 2.0, 0.25]])  # min(ratio, 2)
    torch.testing.assert_close(g_tis, w * g_plain)
    torch.testing.assert_close(m["tis_clipfrac"], torch.tensor(2 / 6))  # 3 and 2.5 exceed the cap
    # nothing reaches the engine's log-probs
    loss_tis2, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(rollout_correction="tis"), rollout_logp=rollout)
    loss_tis2.backward()
    assert rollout.grad is None


def test_opsm_zeroes_sequence_but_keeps_denominator():
    # row 0: A < 0 and mean(rollout - logp) = 0.5 > delta -> its pg terms are 0; row 1 (A > 0) stays.
    # ratio 1: per-token pg = -A -> row 1 gives -1 on 2 tokens; token mean over all 4 tokens = -2 / 4
    logp = torch.zeros(2, 2, requires_grad=True)
    rollout = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    cfg = PolicyLossConfig(rollout_correction="opsm", opsm_delta=0.1)
    loss, m = policy_loss(logp, logp.detach(), torch.tensor([-1.0, 1.0]), torch.ones(2, 2), cfg, rollout_logp=rollout)
    torch.testing.assert_close(loss, torch.tensor(-0.5))
    torch.testing.assert_close(m["opsm_frac"], torch.tensor(0.5))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]]))


def test_mis_rejects_and_weights():
    # rollout ratios old / rollout = [3, 1.5]: token 0 rejected, token 1 weighted by 1.5; A = 1, ratio 1
    # pg = [0, -1.5] -> token mean -0.75
    old = torch.zeros(1, 2)
    rollout = old - torch.tensor([[LN(3.0), LN(1.5)]])
    cfg = PolicyLossConfig(rollout_correction="mis", mis_low=0.5, mis_high=2.0)
    loss, m = policy_loss(old.clone(), old, torch.tensor([1.0]), torch.ones(1, 2), cfg, rollout_logp=rollout)
    torch.testing.assert_close(loss, torch.tensor(-0.75))
    torch.testing.assert_close(m["mis_reject_frac"], torch.tensor(0.5))
    # train-vs-rollout diff (|ln 3| + |ln 1.5|) / 2, ESS of [3, 1.5]: 4.5^2 / (2 * 11.25) = 0.9
    torch.testing.assert_close(m["train_rollout_logprob_abs_diff"], torch.tensor((LN(3) + LN(1.5)) / 2))
    torch.testing.assert_close(m["rollout_ess"], torch.tensor(0.9))


# ---------------------------------------------------------------- API contract


def test_metrics_are_detached_scalars():
    B, T = 2, 3
    logp = (-torch.rand(B, T)).requires_grad_()
    cfg = PolicyLossConfig(kl="k1", kl_coef=0.01, dual_clip_c=3.0, rollout_correction="tis+opsm")
    loss, metrics = policy_loss(
        logp,
        logp.detach() + 0.1,
        torch.tensor([1.0, -1.0]),
        torch.ones(B, T),
        cfg,
        ref_logp=logp.detach() - 0.1,
        rollout_logp=logp.detach(),
    )
    assert loss.requires_grad and loss.dim() == 0
    expected = {
        "loss",
        "pg_loss",
        "kl_loss",
        "pg_clipfrac",
        "dual_clipfrac",
        "approx_kl",
        "ratio_mean",
        "train_rollout_logprob_abs_diff",
        "train_rollout_logprob_abs_diff_max",
        "train_rollout_kl",
        "rollout_ess",
        "tis_clipfrac",
        "opsm_frac",
    }
    assert set(metrics) == expected
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad and v.dtype == torch.float32
    torch.testing.assert_close(metrics["loss"], loss.detach())


def test_missing_or_misshaped_inputs():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, torch.zeros(2), mask, PolicyLossConfig(kl="k3", kl_coef=0.1))
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(x, x, torch.zeros(2), mask, PolicyLossConfig())  # the default TIS needs the engine's
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), mask, PLAIN)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), mask, PLAIN)


def test_kl_reduced_with_loss_mask_only():
    # OPSM masks the pg term of row 0 but the KL regularizer still covers every valid token
    logp = torch.zeros(2, 1)
    ref = torch.full((2, 1), -LN(2.0))
    cfg = PolicyLossConfig(kl="k1", kl_coef=1.0, rollout_correction="opsm", opsm_delta=0.0)
    loss, m = policy_loss(
        logp, logp, torch.tensor([-1.0, 0.0]), torch.ones(2, 1), cfg, ref_logp=ref, rollout_logp=torch.ones(2, 1)
    )
    torch.testing.assert_close(m["kl_loss"], kl_penalty(logp, ref, "k1").mean())
    torch.testing.assert_close(m["pg_loss"], torch.tensor(0.0))


def test_the_train_rollout_gap_metrics_are_the_published_formulas():
    """The largest |d logp| over the mask, and Schulman's k3 estimate of KL(engine || trainer) on the engine's
    samples: mean of (r - 1) - log r with r = pi_train / pi_engine, masked tokens out of both."""
    train = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -9.0]], dtype=torch.float64)
    engine = torch.tensor([[-1.1, -2.0, -0.7], [-0.3, -3.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, metrics = policy_loss(
        train.clone().requires_grad_(), train, torch.zeros(2), mask, PolicyLossConfig(), rollout_logp=engine
    )
    assert float(metrics["train_rollout_logprob_abs_diff_max"]) == pytest.approx(0.5)  # not the masked 8.0
    r = torch.exp(train - engine)[mask.bool()]
    assert float(metrics["train_rollout_kl"]) == pytest.approx(float(((r - 1) - r.log()).mean()))
