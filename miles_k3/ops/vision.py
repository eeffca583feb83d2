"""The vision tower's position terms, attention and patch merge as pure-torch functions (the published
MoonViT3d formulas, as K3's tower uses them).

Patches of one media item come row-major over its (h, w) patch grid, frame after frame (t-major): the
order the processor emits and the tower's tables are laid out in. Media items are concatenated in order,
and `cu_seqlens`-style boundaries (`grid_bounds`) keep attention inside each.

Precision: the rotary and sincos tables are computed, and the rotation applied, in fp32 (fp64 for fp64
inputs, so fp64 exactness tests compare the math, not fp32 rounding), as the released tower does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]  # (t, h, w) in patches
ROPE_THETA = 10000.0


def _real(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def grid_bounds(grids: list[Grid]) -> list[int]:
    """[0, n_0, n_0 + n_1, ...]: where each media item's t * h * w patches start and end."""
    out = [0]
    for t, h, w in grids:
        out.append(out[-1] + t * h * w)
    return out


def sincos_time_embedding(dim: int, frames: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fixed time term [frames, dim]: [sin(f w_i) | cos(f w_i)] with w_i = 10000^(-i / (dim / 2)),
    i < dim / 2, frame f (computed in fp32, fp64 for fp64)."""
    real = _real(dtype)
    omega = 1.0 / ROPE_THETA ** (torch.arange(dim // 2, dtype=real, device=device) / (dim / 2.0))
    angles = torch.outer(torch.arange(frames, dtype=real, device=device), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1).to(dtype)


def position_embedding(table: torch.Tensor, grids: list[Grid], mode: str) -> torch.Tensor:
    """The additive position term of every patch [sum t*h*w, D]: the learned table [H0, W0, D] resized to
    each item's (h, w) (`mode` interpolation, half-pixel centres; the table itself when the sizes match),
    flattened row-major, repeated per frame and, for t > 1 only, plus the sincos time term of the frame."""
    out = []
    for t, h, w in grids:
        if (h, w) == tuple(table.shape[:2]):
            spatial = table.reshape(h * w, -1)
        else:
            spatial = (
                F.interpolate(table.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode=mode, align_corners=False)
                .squeeze(0)
                .permute(1, 2, 0)
                .reshape(h * w, -1)
            )
        if t > 1:
            time = sincos_time_embedding(table.shape[-1], t, table.dtype, table.device)
            spatial = (spatial.unsqueeze(0) + time.unsqueeze(1)).reshape(t * h * w, -1)
        out.append(spatial)
    return torch.cat(out)


def rope_2d(grids: list[Grid], head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """cis of every patch's rotary angles, complex [sum t*h*w, head_dim / 2]: with f_i = 10000^(-4i / head_dim)
    (i < head_dim / 4), complex pair 2i turns by column * f_i and pair 2i + 1 by row * f_i (the patch's place
    in its frame; every frame of an item the same)."""
    real = _real(dtype)
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 4, dtype=real, device=device)[: head_dim // 4] / head_dim)
    out = []
    for t, h, w in grids:
        row = torch.arange(h, dtype=real, device=device).repeat_interleave(w)
        col = torch.arange(w, dtype=real, device=device).repeat(h)
        angles = torch.stack([torch.outer(col, freqs), torch.outer(row, freqs)], dim=-1).reshape(h * w, -1)
        out.append(torch.polar(torch.ones_like(angles), angles).repeat(t, 1))
    return torch.cat(out)


def apply_rope_2d(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated pairwise (elements 2j, 2j + 1 as one complex number) by cis [N, head_dim / 2],
    the same for every head; computed in cis's precision, returned in x's dtype."""
    xc = torch.view_as_complex(x.to(cis.real.dtype).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis.unsqueeze(-2)).flatten(-2).to(x.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Bidirectional softmax attention inside each [bounds[i], bounds[i+1]) segment, never across.
    q, k, v [N, heads, head_dim] -> [N, heads * head_dim]; scale head_dim^-0.5."""
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (z[a:b].transpose(0, 1).unsqueeze(0) for z in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi).squeeze(0).transpose(0, 1))
    return torch.cat(outs).flatten(-2)


def merge_patches(x: torch.Tensor, grids: list[Grid], kernel: tuple[int, int]) -> torch.Tensor:
    """x [sum t*h*w, D] -> merged tokens [sum (h/kh)(w/kw), kh*kw*D]: per item, each kh x kw block of the
    patch grid becomes one token (its patches concatenated row-major inside the block), averaged over the
    item's frames; tokens come row-major over the merged grid, items in order."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grids:
        item = x[start : start + t * h * w].reshape(t, h // kh, kh, w // kw, kw, x.shape[-1])
        out.append(item.permute(0, 1, 3, 2, 4, 5).mean(dim=0).reshape((h // kh) * (w // kw), -1))
        start += t * h * w
    return torch.cat(out)
