"""Per-token KL estimators against the reference (base) policy.

The reference is the frozen base with the LoRA adapter disabled, so it costs a
forward pass and no weights. Samples come from the policy, and with
d = logp - ref_logp (log pi_theta / pi_ref at the sampled token), Schulman's
estimators of KL(pi_theta || pi_ref) (http://joschu.net/blog/kl-approx.html):

    k1 = d                         unbiased, high variance, can be negative
    k2 = d^2 / 2                   biased, low variance, >= 0
    k3 = exp(-d) + d - 1           unbiased, low variance, >= 0
       = exp(ref - logp) - (ref - logp) - 1

Used as a loss (differentiated through logp, not through the sampling), the
per-token gradients and their expectations under pi_theta are:

    k1: grad(logp)                 E = 0: as a loss k1 only adds noise (it is meant as a reward penalty)
    k2: d * grad(logp)             E = grad KL(pi_theta || pi_ref), the reverse KL
    k3: (1 - exp(-d)) grad(logp)   E = grad KL(pi_ref || pi_theta), the forward KL

No clamping: a blow-up of k3 means the policy has left the base far behind,
and hiding it would hide the problem.
"""

from __future__ import annotations

import torch

__all__ = ["KL_ESTIMATORS", "kl_penalty"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate `kind` in KL_ESTIMATORS. logp, ref_logp [B, T] -> [B, T].

    The gradient flows through `logp` only (the reference is a constant).
    """
    d = logp - ref_logp.detach()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
