"""Attention Residuals mixing (arXiv 2603.15031), in fp32 (fp64 for fp64 inputs).

    v = stack(blocks + [h])                       [L, ..., D]
    keys = v / sqrt(mean(v^2, -1) + eps)          (no weight)
    query = site_norm.weight * site_proj.weight[0]
    out = softmax_L(keys . query) @ v
Folding the norm weight into the query is exact: (k * w) . q == k . (w * q).

`attn_res_mix` runs its Triton kernel (`miles_k3.kernels.attnres`: one launch, no stack) where
`miles_k3.kernels.use_kernels` says so and the kernel takes the call; the code below is the definition the
kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_k3.kernels import use_kernels
from miles_k3.ops.norm import rms_norm


def attn_res_mix(
    h: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """h [..., D] and each block [..., D] -> [..., D] in h's dtype. proj_weight [1, D] (a Linear(D, 1))."""
    if use_kernels(h):
        from miles_k3.kernels import attnres as kernels  # imported here: CPU installs never load triton

        if kernels.supports(h, blocks, norm_weight, proj_weight):
            return kernels.attn_res_mix(h, blocks, norm_weight, proj_weight, eps)
    dtype = torch.promote_types(h.dtype, torch.float32)
    v = torch.stack([*blocks, h], dim=0).to(dtype)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    query = norm_weight.to(dtype) * proj_weight.to(dtype)[0]
    probs = torch.softmax(keys @ query, dim=0)
    return (probs.unsqueeze(-1) * v).sum(0).to(h.dtype)


def attn_res_mix_rms_norm(
    h: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
    out_weight: torch.Tensor,
    out_eps: float,
) -> torch.Tensor:
    """`rms_norm(attn_res_mix(h, blocks, norm_weight, proj_weight, eps), out_weight, out_eps)`: a layer's
    norm of its mixed input, which the kernel computes in the same launch as the mix."""
    if use_kernels(h):
        from miles_k3.kernels import attnres as kernels

        if kernels.supports(h, blocks, norm_weight, proj_weight, (out_weight, out_eps)):
            return kernels.attn_res_mix(h, blocks, norm_weight, proj_weight, eps, (out_weight, out_eps))
    return rms_norm(attn_res_mix(h, blocks, norm_weight, proj_weight, eps), out_weight, out_eps)


def add_attn_res_mix_rms_norm(
    h: torch.Tensor,
    add: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
    out_weight: torch.Tensor,
    out_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = h + add` and `attn_res_mix_rms_norm(h, blocks, ...)` -> (h, normed): a layer's residual add and
    the norm of the mix after it, which the kernel computes in one launch (the sum bit for bit)."""
    if use_kernels(h):
        from miles_k3.kernels import attnres as kernels

        if kernels.supports(h, blocks, norm_weight, proj_weight, (out_weight, out_eps), add):
            return kernels.add_attn_res_mix(h, add, blocks, norm_weight, proj_weight, eps, (out_weight, out_eps))
    h = h + add
    return h, attn_res_mix_rms_norm(h, blocks, norm_weight, proj_weight, eps, out_weight, out_eps)
