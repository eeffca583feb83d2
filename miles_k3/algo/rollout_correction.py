"""Train-vs-rollout (off-policy) correction against the engine's log-probs.

The engine samples with pi_rollout (MXFP4 base + LoRA, its own kernels), the
trainer recomputes pi_old (BF16, megatron) and optimizes pi_theta. PPO's ratio
pi_theta / pi_old anchors the trust region; the factor pi_old / pi_rollout is
the importance weight that makes the gradient about samples from pi_rollout
(decoupled PPO, three policies). All weights here are constants (detached):
they rescale or drop a token's gradient, they are never optimized.

Shapes: old_logp, rollout_logp, logp, loss_mask [B, T]; log-probs fp32.
w_t = exp(old_logp_t - rollout_logp_t) is the per-token rollout ratio.

    TIS  (truncated IS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
         weight_t = min(w_t, C)
    MIS  (masked IS): keep a token / sequence only if its ratio rho is in [lo, hi], and weight it by rho:
         token      rho_t = w_t
         sequence   rho_i = prod_t w_t = exp(sum_t log w_t)     (the exact sequence IS ratio)
         geometric  rho_i = exp(mean_t log w_t)                 (length-invariant)
         weight = rho * [lo <= rho <= hi]
    OPSM (off-policy sequence masking, DeepSeek-V3.2, arXiv 2512.02556):
         M_i,t = 0 if A_i,t < 0 and (1/|o_i|) sum_t log(pi_old(o_t) / pi_theta(o_t)) > delta, else 1
         where the paper's pi_old is "the sampling probability directly returned by the inference
         framework", i.e. our rollout_logp, and pi_theta the current policy (logp, detached here): the
         mean is a per-sequence estimate of KL(pi_rollout || pi_theta), so one test covers both engine
         mismatch and policy staleness. Only negative-advantage sequences are dropped: pushing down a
         sample the current policy would hardly produce is where off-policy updates do harm.
    ESS  (effective sample size, normalized to (0, 1]): (sum w)^2 / (n * sum w^2) over the n valid tokens;
         1 for uniform weights, 1/n for one-hot weights.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from miles_k3.algo.reducers import as_bool_mask, masked_mean, masked_sum

__all__ = [
    "MIS_LEVELS",
    "MISResult",
    "OPSMResult",
    "rollout_log_ratio",
    "tis_weights",
    "mis_weights",
    "opsm_mask",
    "effective_sample_size",
]

MIS_LEVELS = ("token", "sequence", "geometric")


class MISResult(NamedTuple):
    weight: torch.Tensor  # [B, T] fp32, detached: rho where kept, 0 where rejected or off the mask
    keep: torch.Tensor  # [B, T] bool: on the mask and inside [lo, hi]


class OPSMResult(NamedTuple):
    keep: torch.Tensor  # [B, T] bool: on the mask and not masked by OPSM
    seq_kl: torch.Tensor  # [B] fp32: (1/|o_i|) sum_t (rollout_logp - logp), 0 for empty rows


def rollout_log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log w_t = old_logp - rollout_logp on the mask, 0 off it (so exp never sees padding). Detached."""
    diff = old_logp.detach() - rollout_logp.detach()
    return torch.where(as_bool_mask(loss_mask), diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """TIS weight min(exp(old - rollout), cap), detached; 0 off the mask. [B, T] -> [B, T]."""
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    w = torch.exp(rollout_log_ratio(old_logp, rollout_logp, loss_mask)).clamp(max=cap)
    return torch.where(as_bool_mask(loss_mask), w, torch.zeros_like(w))


def mis_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    low: float,
    high: float,
    level: str = "token",
) -> MISResult:
    """MIS: reject tokens / sequences whose ratio is outside [low, high], IS-weight the rest (formulas above).

    The bounds are tested in log space, so a sequence ratio that overflows fp32
    is still rejected cleanly rather than turning into inf * 0.
    """
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"MIS bounds need 0 <= low <= 1 <= high, got low={low}, high={high}")
    valid = as_bool_mask(loss_mask)
    log_w = rollout_log_ratio(old_logp, rollout_logp, valid)
    if level == "token":
        log_rho = log_w
    elif level == "sequence":
        log_rho = log_w.sum(-1, keepdim=True).expand_as(log_w)
    elif level == "geometric":
        log_rho = masked_mean(log_w, valid, -1)[:, None].expand_as(log_w)
    else:
        raise ValueError(f"unknown MIS level {level!r}; expected one of {MIS_LEVELS}")
    log_low = math.log(low) if low > 0 else -math.inf  # low = 0: nothing is rejected from below
    keep = valid & (log_rho >= log_low) & (log_rho <= math.log(high))
    weight = torch.where(keep, torch.exp(torch.where(keep, log_rho, 0.0)), 0.0)
    return MISResult(weight, keep)


def opsm_mask(
    logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, delta: float
) -> OPSMResult:
    """DeepSeek-V3.2 off-policy sequence mask (formula above). advantages [B] or [B, T].

    `logp` is the current policy's log-prob (read, not differentiated).
    """
    valid = as_bool_mask(loss_mask)
    seq_kl = masked_mean(rollout_logp.detach() - logp.detach(), valid, -1)
    adv = advantages.detach()
    adv = adv[:, None].expand_as(valid) if adv.dim() == 1 else adv
    drop = (adv < 0) & (seq_kl[:, None] > delta)
    return OPSMResult(valid & ~drop, seq_kl)


def effective_sample_size(weights: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Normalized ESS = (sum w)^2 / (n sum w^2) over the mask, in (0, 1]; 0 if empty or all w = 0. -> []."""
    w = weights.detach()
    n = as_bool_mask(loss_mask).sum().to(w.dtype)
    sum_w = masked_sum(w, loss_mask)
    sum_w2 = masked_sum(w * w, loss_mask)
    return sum_w * sum_w / (n * sum_w2).clamp_min(torch.finfo(w.dtype).tiny)
