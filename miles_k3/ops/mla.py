"""Attention core for NoPE MLA: scaled-dot-product attention with an explicit mask.

MLA here is standard multi-head attention once the latent is expanded: every
head's key is [k_nope | k_rope], with k_rope shared by all heads and never
rotated (K3 has no rotary embedding). The softmax scale is (nope + rope)^-0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Bool [q_len, k_len]: query i (the last q_len of k_len positions) sees keys <= its position."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    return torch.arange(k_len, device=device)[None, :] <= q_pos[:, None]


def segment_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """Bool [T, T] for packed sequences: causal and within the same segment."""
    seg = torch.zeros(total, dtype=torch.long, device=device)
    seg[cu_seqlens[1:-1].to(device)] = 1
    seg = seg.cumsum(0)
    return (seg[:, None] == seg[None, :]) & causal_mask(total, total, device)


def mla_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv], mask bool broadcastable to [B, H, T, S]
    (True = attend) or None for plain causal with T == S. Returns [B, T, H, Dv]."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2)
