"""Training metrics: small functions returning detached fp32 tensors (no .item(), so no device sync).

pg_clipfrac                  mean over the mask of 1[clip binds]
approx_kl                    mean over the mask of k3 for KL(pi_old || pi_theta), samples from pi_old:
                             r = exp(logp - old_logp), k3 = (r - 1) - log r
entropy_from_logits          H = logsumexp(z) - sum_v softmax(z)_v z_v per token, chunked over the vocab
logprob_abs_diff             mean over the mask of |logp_a - logp_b| (train vs rollout)
reward_stats                 mean and population std (ddof 0, as in `advantages`) of the rewards
"""

from __future__ import annotations

import torch

from miles_k3.algo.kl import kl_penalty
from miles_k3.algo.reducers import as_bool_mask, masked_mean

__all__ = ["pg_clipfrac", "approx_kl", "entropy_from_logits", "logprob_abs_diff", "reward_stats"]


def pg_clipfrac(clipped: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Fraction of valid tokens whose clip binds. clipped [B, T] bool -> []."""
    return masked_mean(clipped.detach().float(), loss_mask)


def approx_kl(logp: torch.Tensor, old_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_old || pi_theta), averaged over the mask. [B, T] -> [].

    The samples come from pi_old, so pi_old plays the role of "the policy" in
    Schulman's k3 and pi_theta the reference: kl_penalty(old_logp, logp, "k3").
    """
    valid = as_bool_mask(loss_mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    old = torch.where(valid, old_logp.detach(), zero)
    cur = torch.where(valid, logp.detach(), zero)
    return masked_mean(kl_penalty(old, cur, "k3"), valid)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 8192) -> torch.Tensor:
    """Per-token entropy of softmax(logits) in fp32. logits [..., V] (any float dtype) -> [...].

    One pass over vocab chunks with an online logsumexp: only a [..., chunk]
    fp32 slice exists at a time, so a [B, T, 160k] bf16 logits tensor never
    gets a full fp32 copy. Running max m, s = sum exp(z - m), t = sum exp(z - m) z;
    when m grows both sums are rescaled by exp(m_old - m_new). Then
    H = m + log s - t / s. Logits of -inf (masked vocab) contribute 0.
    Meant for metrics (call under no_grad); it is differentiable, but autograd
    then keeps every chunk.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    batch_shape = logits.shape[:-1]
    m = torch.full(batch_shape, -torch.inf, dtype=torch.float32, device=logits.device)
    s = torch.zeros(batch_shape, dtype=torch.float32, device=logits.device)
    t = torch.zeros(batch_shape, dtype=torch.float32, device=logits.device)
    for chunk in logits.split(chunk_size, dim=-1):
        z = chunk.float()
        m_new = torch.maximum(m, z.amax(-1))
        # While every logit so far is -inf, any finite shift works (all terms are 0).
        shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        scale = torch.exp(m - shift)
        e = torch.exp(z - shift[..., None])
        s = s * scale + e.sum(-1)
        t = t * scale + torch.where(e > 0, e * z, torch.zeros_like(z)).sum(-1)
        m = m_new
    return m + torch.log(s) - t / s


def logprob_abs_diff(logp_a: torch.Tensor, logp_b: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """mean over the mask of |logp_a - logp_b| (e.g. trainer vs engine log-probs). [B, T] -> []."""
    return masked_mean((logp_a.detach() - logp_b.detach()).abs(), loss_mask)


def reward_stats(rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"reward_mean", "reward_std"} over all rewards (any shape), population std: fp32 scalars (fp64 for
    fp64 input); NaN for no rewards."""
    r = rewards.detach().reshape(-1)
    if not r.is_floating_point() or r.element_size() < 4:  # ints, bools, fp16/bf16 -> fp32
        r = r.float()
    if r.numel() == 0:
        nan = torch.full((), float("nan"), dtype=r.dtype, device=r.device)
        return {"reward_mean": nan, "reward_std": nan.clone()}
    return {"reward_mean": r.mean(), "reward_std": r.std(correction=0)}
