"""RMSNorm and sigmoid-gated RMSNorm, the published formulas in fp32.

RMSNorm follows Kimi-Linear / transformers: normalize in fp32, cast back to the
input dtype, then scale by the weight (the order matters in bf16 and is what
the oracle does). The gated form keeps everything in fp32 until the end, as
fla's fused gated norm does.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype (times weight's promotion)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * sigmoid(gate), all in fp32. x, gate [..., D]; weight [D]; returns x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)
