"""The composed GRPO-family policy loss: one config, one function.

Per valid token t of sequence i (m the loss mask, A the advantage):

    pg_t   = clipped_surrogate(log_ratio_t, A_t).loss * c_t * keep_t
    kl_t   = kl_penalty(logp_t, ref_logp_t)                           (if kl != "none")
    loss   = reduce(pg) + kl_coef * reduce(kl)

log_ratio is "token" (logp - old_logp) or "gspo" (GSPO-token form), c_t the
rollout-correction weight (TIS: min(w, C); MIS: rho in [lo, hi]; else 1) and
keep_t the MIS / OPSM mask. Rejected tokens are zeroed, not dropped from the
reducer's denominator: the DeepSeek-V3.2 objective puts M_i,t inside the
1/|o_i| sum, and dropping a sample should not up-weight the rest of the batch.
The correction and masks act on the policy-gradient term only; the KL term is a
regularizer toward the base and stays on every valid token (as in slime/miles).
TIS and token-level MIS weights stay per token under ratio="gspo" too; use
mis_level "sequence" / "geometric" for a per-sequence correction.

Padding hygiene: every input is replaced by 0 off the mask before any exp, so
NaN / inf log-probs in padding reach neither the loss nor the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from miles_k3.algo.advantages import expand_to_tokens
from miles_k3.algo.kl import KL_ESTIMATORS, kl_penalty
from miles_k3.algo.metrics import approx_kl, logprob_abs_diff, pg_clipfrac
from miles_k3.algo.policy_loss import clipped_surrogate, gspo_log_ratio, token_log_ratio
from miles_k3.algo.reducers import REDUCERS, as_bool_mask, masked_mean, reduce_loss
from miles_k3.algo.rollout_correction import (
    MIS_LEVELS,
    effective_sample_size,
    mis_weights,
    opsm_mask,
    rollout_log_ratio,
    tis_weights,
)

__all__ = ["RATIO_TYPES", "KL_TYPES", "ROLLOUT_CORRECTIONS", "PolicyLossConfig", "policy_loss"]

RATIO_TYPES = ("token", "gspo")
KL_TYPES = ("none", *KL_ESTIMATORS)
# TIS and MIS both reweight by pi_old / pi_rollout, so they exclude each other; OPSM masks and composes.
ROLLOUT_CORRECTIONS = ("none", "tis", "mis", "opsm", "tis+opsm", "mis+opsm")


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Options of `policy_loss`. Validated on construction; ValueError starting with
    `PolicyLossConfig.<field>`.

    Fields of a method that is switched off (tis_cap without TIS, ...) are not read.
    Defaults: GRPO as the trainer runs it (`algo.*` takes them): DAPO's clip-higher
    (0.2 / 0.28), no KL, token-mean, TIS against the engine's log-probs; the
    correction thresholds are slime/miles' (TIS cap 2, OPSM delta 1e-4).
    """

    eps_low: float = 0.2  # ratio floor 1 - eps_low, in [0, 1)
    eps_high: float = 0.28  # ratio ceiling 1 + eps_high (DAPO clip-higher; PPO: 0.2)
    dual_clip_c: float | None = None  # dual-clip bound for A < 0, > 1 (typically 3); None = off
    ratio: str = "token"  # RATIO_TYPES; "gspo" wants eps ~ 3e-4 / 4e-4
    kl: str = "none"  # KL_TYPES, against the base (adapter disabled)
    kl_coef: float = 0.0  # beta >= 0; must be 0 when kl == "none"
    reducer: str = "token_mean"  # REDUCERS
    max_response_len: int | None = None  # Dr.GRPO's constant divisor; required by reducer "dr_grpo"
    rollout_correction: str = "tis"  # ROLLOUT_CORRECTIONS; "tis" and "mis" need rollout_logp
    tis_cap: float = 2.0  # TIS truncation C > 0
    mis_low: float = 0.5  # MIS keeps rho in [mis_low, mis_high]
    mis_high: float = 2.0  # (>= 1)
    mis_level: str = "token"  # MIS_LEVELS
    opsm_delta: float = 1e-4  # OPSM threshold on the mean log ratio (>= 0)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"PolicyLossConfig.{name} {rule}, got {getattr(self, name)!r}")

        def finite(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")

        for name in ("eps_low", "eps_high", "kl_coef", "tis_cap", "mis_low", "mis_high", "opsm_delta"):
            finite(name)
        if not 0.0 <= self.eps_low < 1.0:
            raise bad("eps_low", "must be in [0, 1)")
        if self.eps_high < 0.0:
            raise bad("eps_high", "must be >= 0")
        if self.dual_clip_c is not None:
            finite("dual_clip_c")
            if self.dual_clip_c <= 1.0:
                raise bad("dual_clip_c", "must be > 1 (or None to disable dual-clip)")
        if self.ratio not in RATIO_TYPES:
            raise bad("ratio", f"must be one of {RATIO_TYPES}")
        if self.kl not in KL_TYPES:
            raise bad("kl", f"must be one of {KL_TYPES}")
        if self.kl_coef < 0.0:
            raise bad("kl_coef", "must be >= 0")
        if self.kl == "none" and self.kl_coef != 0.0:
            raise bad("kl_coef", "must be 0 when kl is 'none' (pick an estimator: k1, k2 or k3)")
        if self.reducer not in REDUCERS:
            raise bad("reducer", f"must be one of {REDUCERS}")
        if self.max_response_len is not None and (
            isinstance(self.max_response_len, bool)
            or not isinstance(self.max_response_len, int)
            or self.max_response_len <= 0
        ):
            raise bad("max_response_len", "must be a positive int")
        if self.reducer == "dr_grpo" and self.max_response_len is None:
            raise bad("max_response_len", "is required by reducer 'dr_grpo' (the generation limit)")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise bad("rollout_correction", f"must be one of {ROLLOUT_CORRECTIONS}")
        if self.tis_cap <= 0.0:
            raise bad("tis_cap", "must be > 0")
        if not 0.0 <= self.mis_low <= 1.0:
            raise bad("mis_low", "must be in [0, 1]")
        if self.mis_high < 1.0:
            raise bad("mis_high", "must be >= 1")
        if self.mis_level not in MIS_LEVELS:
            raise bad("mis_level", f"must be one of {MIS_LEVELS}")
        if self.opsm_delta < 0.0:
            raise bad("opsm_delta", "must be >= 0")

    @property
    def corrections(self) -> frozenset[str]:
        """The enabled rollout corrections, e.g. {"tis", "opsm"}; empty for "none"."""
        return frozenset() if self.rollout_correction == "none" else frozenset(self.rollout_correction.split("+"))


def _check_shape(name: str, x: torch.Tensor | None, shape: torch.Size) -> None:
    if x is not None and x.shape != shape:
        raise ValueError(f"{name} must be [B, T] = {tuple(shape)} like loss_mask, got {tuple(x.shape)}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-family loss (formula: module docstring) and its metrics.

    Args:
        logp: [B, T] fp32, current policy log-probs of the sampled tokens (requires grad).
        old_logp: [B, T] fp32, trainer log-probs before this step's updates (constant).
        advantages: [B] per sequence or [B, T] per token.
        loss_mask: [B, T] bool or 0/1, response tokens that carry loss.
        ref_logp: [B, T], base-policy log-probs; required iff config.kl != "none".
        rollout_logp: [B, T], the engine's log-probs; required iff a rollout correction is on.
        num_tokens, num_sequences: global reducer denominators (gradient accumulation), see `reducers`.

    Returns:
        (loss [] fp32 with grad, metrics: name -> detached fp32 scalar tensor). Metrics always
        include loss, pg_loss, pg_clipfrac, approx_kl (old vs current, k3), ratio_mean; plus
        dual_clipfrac, kl_loss, and with rollout_logp: train_rollout_logprob_abs_diff (its mean; _max: the
        largest), train_rollout_kl (k3 estimate of KL(engine || trainer)),
        rollout_ess (of the raw ratio pi_old / pi_rollout), tis_clipfrac, mis_reject_frac, opsm_frac.
    """
    shape = loss_mask.shape
    if len(shape) != 2:
        raise ValueError(f"loss_mask must be [B, T], got {tuple(shape)}")
    for name, x in (("logp", logp), ("old_logp", old_logp), ("ref_logp", ref_logp), ("rollout_logp", rollout_logp)):
        _check_shape(name, x, shape)
    if config.kl != "none" and ref_logp is None:
        raise ValueError(f"config.kl={config.kl!r} needs ref_logp")
    if config.corrections and rollout_logp is None:
        raise ValueError(f"config.rollout_correction={config.rollout_correction!r} needs rollout_logp")

    valid = as_bool_mask(loss_mask)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)

    def clean(x: torch.Tensor) -> torch.Tensor:  # fp32, 0 off the mask (no NaN/inf past this point)
        return torch.where(valid, x.float(), zero)

    logp, old_logp = clean(logp), clean(old_logp.detach())
    adv = clean(expand_to_tokens(advantages.detach(), valid))
    if config.ratio == "token":
        log_ratio = token_log_ratio(logp, old_logp)
    else:
        log_ratio = gspo_log_ratio(logp, old_logp, valid)
    clip = clipped_surrogate(log_ratio, adv, config.eps_low, config.eps_high, config.dual_clip_c)
    pg = clip.loss

    metrics: dict[str, torch.Tensor] = {}
    if rollout_logp is not None:
        rollout_logp = clean(rollout_logp.detach())
        raw_w = torch.exp(rollout_log_ratio(old_logp, rollout_logp, valid))
        metrics["train_rollout_logprob_abs_diff"] = logprob_abs_diff(old_logp, rollout_logp, valid)
        gap = torch.where(valid, (old_logp.detach() - rollout_logp).abs(), torch.zeros_like(old_logp))
        metrics["train_rollout_logprob_abs_diff_max"] = gap.max()
        # k3 estimate of KL(engine || trainer) over the sampled tokens (the engine drew them)
        metrics["train_rollout_kl"] = approx_kl(old_logp, rollout_logp, valid)
        metrics["rollout_ess"] = effective_sample_size(raw_w, valid)
    if "tis" in config.corrections:
        pg = pg * tis_weights(old_logp, rollout_logp, valid, config.tis_cap)
        metrics["tis_clipfrac"] = masked_mean((raw_w > config.tis_cap).float(), valid)
    if "mis" in config.corrections:
        mis = mis_weights(old_logp, rollout_logp, valid, config.mis_low, config.mis_high, config.mis_level)
        pg = pg * mis.weight  # rho where kept, 0 where rejected
        metrics["mis_reject_frac"] = masked_mean((valid & ~mis.keep).float(), valid)
    if "opsm" in config.corrections:
        opsm = opsm_mask(logp, rollout_logp, adv, valid, config.opsm_delta)
        pg = torch.where(opsm.keep, pg, zero)
        metrics["opsm_frac"] = masked_mean((valid & ~opsm.keep).float(), valid)

    reduce_kw = dict(max_response_len=config.max_response_len, num_tokens=num_tokens, num_sequences=num_sequences)
    pg_loss = reduce_loss(pg, valid, config.reducer, **reduce_kw)
    loss = pg_loss
    if config.kl != "none":
        kl_loss = reduce_loss(kl_penalty(logp, clean(ref_logp.detach()), config.kl), valid, config.reducer, **reduce_kw)
        loss = loss + config.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()

    metrics["loss"] = loss.detach()
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = pg_clipfrac(clip.clipped, valid)
    if config.dual_clip_c is not None:
        metrics["dual_clipfrac"] = pg_clipfrac(clip.dual_clipped, valid)
    metrics["approx_kl"] = approx_kl(logp, old_logp, valid)
    metrics["ratio_mean"] = masked_mean(clip.ratio.detach(), valid)
    return loss, metrics
