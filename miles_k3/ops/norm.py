"""RMSNorm and sigmoid-gated RMSNorm, the published formulas in fp32 (fp64 for fp64 inputs, so fp64
exactness tests compare the math, not fp32 rounding).

RMSNorm follows Kimi-Linear / transformers: normalize in fp32, cast back to the
input dtype, then scale by the weight (the order matters in bf16 and is what
the oracle does). The gated form keeps everything in fp32 until the end, as
fla's fused gated norm does.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype (times weight's promotion)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * sigmoid(gate), all in fp32. x, gate [..., D]; weight [D]; returns x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(dtype) * torch.sigmoid(gate.to(dtype))).to(x.dtype)
