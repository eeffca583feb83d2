"""RMSNorm and sigmoid-gated RMSNorm, the published formulas in fp32 (fp64 for fp64 inputs, so fp64
exactness tests compare the math, not fp32 rounding).

RMSNorm follows Kimi-Linear / transformers: normalize in fp32, cast back to the
input dtype, then scale by the weight (the order matters in bf16 and is what
the oracle does). The gated form keeps everything in fp32 until the end, as
fla's fused gated norm does.

Both run their Triton kernel (`miles_k3.kernels.norm`: one launch instead of about eight) where
`miles_k3.kernels.use_kernels` says so and the kernel takes the call (fp32 / bf16 / fp16, rows it can
address); the code below is the definition the kernels are tested against.
"""

from __future__ import annotations

import torch

from miles_k3.kernels import use_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype (times weight's promotion)."""
    if use_kernels(x):
        from miles_k3.kernels import norm as kernels  # imported here: CPU installs never load triton

        if kernels.supports(x, weight):
            return kernels.rms_norm(x, weight, eps)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * sigmoid(gate), all in fp32. x, gate [..., D]; weight [D]; returns x's dtype."""
    if use_kernels(x):
        from miles_k3.kernels import norm as kernels

        if kernels.supports(x, weight, gate):
            return kernels.gated_rms_norm(x, gate, weight, eps)
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(dtype) * torch.sigmoid(gate.to(dtype))).to(x.dtype)
