"""Importance ratios and the clipped (PPO / DAPO / dual-clip) surrogate, per token.

Shapes: logp, old_logp, advantages, loss_mask [B, T]; log-probs fp32.
`logp` is the current policy (carries the gradient), `old_logp` the policy the
ratio is anchored to (the trainer's recomputation before this step's updates;
always treated as a constant).

Ratios (in log space, so callers can sanitize padding before the exp):

    token:  log r_t = logp_t - old_logp_t
    GSPO (arXiv 2507.18071, "GSPO-token" form, eq. for s_{i,t}):
            log s_i   = (1/|y_i|) sum_t (logp_t - old_logp_t)          (sequence ratio s_i = geometric mean)
            log s_i,t = sg[log s_i] + logp_t - sg[logp_t]
        so s_i,t == s_i in value while d s_i,t / d logp_t' = s_i * [t == t'],
        i.e. grad = s_i * A * grad(logp_t) per token. With per-sequence mean
        reduction and a sequence-constant advantage this is exactly GSPO's
        sequence-level gradient; it also allows per-token advantages. GSPO's
        clip range is ~1e-3 wide (the paper uses eps_low 3e-4, eps_high 4e-4),
        not PPO's 0.2, because s_i is a per-token geometric mean.

Clipped surrogate, eps_low / eps_high separate (DAPO "clip-higher", arXiv 2503.14476):

    L1 = -A r,  L2 = -A clip(r, 1 - eps_low, 1 + eps_high)
    L  = max(L1, L2)                              (PPO: the pessimistic bound)
    clipped = L2 > L1                             (the clip binds: the token's gradient is 0)

Dual-clip (Ye et al. 2019, arXiv 1912.09729), c > 1, only for A < 0:

    L = min(L, -c A)                              (a huge ratio on a bad action cannot
    dual_clipped = A < 0 and L_ppo > -c A          blow the loss up; gradient 0 there)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from miles_k3.algo.reducers import as_bool_mask

__all__ = ["ClipResult", "token_log_ratio", "gspo_log_ratio", "clipped_surrogate"]


class ClipResult(NamedTuple):
    """Per-token output of `clipped_surrogate`, all [B, T]."""

    loss: torch.Tensor  # fp32, to be reduced over the loss mask
    ratio: torch.Tensor  # r (or s_i,t), carries the gradient
    clipped: torch.Tensor  # bool: the eps clip binds
    dual_clipped: torch.Tensor  # bool: the dual-clip bound binds (all False without dual-clip)


def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log r_t = logp_t - sg[old_logp_t]. [B, T] -> [B, T]."""
    return logp - old_logp.detach()


def gspo_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token log ratio sg[log s_i] + logp_t - sg[logp_t]. [B, T] -> [B, T].

    log s_i is the masked mean of (logp - old_logp) over row i's response
    tokens (0 for an empty row). Values off the mask are irrelevant but finite
    if the inputs are.
    """
    valid = as_bool_mask(loss_mask)
    delta = torch.where(valid, logp.detach() - old_logp.detach(), torch.zeros((), dtype=logp.dtype, device=logp.device))
    log_s = delta.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1).to(logp.dtype)
    return log_s + (logp - logp.detach())


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None = None
) -> ClipResult:
    """Per-token PPO-clip loss with clip-higher and optional dual-clip (formulas: module docstring).

    log_ratio, advantages [B, T] (advantages broadcast, e.g. [B, 1], is fine).
    The caller is responsible for finite log ratios at masked positions.
    """
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    advantages = advantages.detach()
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    if dual_clip_c is None:
        return ClipResult(loss, ratio, clipped, torch.zeros_like(clipped))
    bound = -dual_clip_c * advantages
    negative = advantages < 0
    dual_clipped = negative & (loss > bound)
    loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return ClipResult(loss, ratio, clipped, dual_clipped)
