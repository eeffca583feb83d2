"""Attention core for NoPE MLA: scaled-dot-product attention with an explicit mask.

MLA here is standard multi-head attention once the latent is expanded: every
head's key is [k_nope | k_rope], with k_rope shared by all heads and never
rotated (K3 has no rotary embedding). The softmax scale is (nope + rope)^-0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_k3.ops.kda import _cu_seqlens_bounds


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Bool [q_len, k_len]: query i (the last q_len of k_len positions) sees keys <= its position."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    return torch.arange(k_len, device=device)[None, :] <= q_pos[:, None]


def mla_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv], mask bool broadcastable to [B, H, T, S]
    (True = attend) or None for plain causal with T == S. Returns [B, T, H, Dv]."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention within each of the N sequences packed in q [1, T, H, Dqk], k [1, T, H, Dqk],
    v [1, T, H, Dv] (bounds `cu_seqlens` [N+1]). Returns [1, T, H, Dv].

    Runs as one right-padded causal batch [N, H, T_max, .]: a real query at position i sees keys <= i of
    its own sequence only, so padding (which comes after) is never attended. Costs N T_max^2 instead of the
    T^2 a [T, T] segment mask costs (and its backward), which matters for RL batches of many short sequences.
    """
    n_tok = q.shape[1]
    bounds = _cu_seqlens_bounds(cu_seqlens, q.shape[0], n_tok)
    cu = torch.tensor(bounds)
    lens, starts = cu.diff(), cu[:-1]
    n, t_max = len(lens), int(lens.max())
    # One gather in, one gather out (no per-sequence slicing: RL batches pack hundreds of sequences).
    # Padded slot (i, j) reads token starts_i + j, or the zero row appended at index T past its end;
    # token t of sequence i comes back from row i * T_max + (t - starts_i).
    j = torch.arange(t_max)
    src = torch.where(j[None, :] < lens[:, None], starts[:, None] + j[None, :], n_tok)
    seq = torch.repeat_interleave(torch.arange(n), lens)
    back = seq * t_max + torch.arange(n_tok) - starts[seq]
    src, back = (x.to(q.device, non_blocking=True) for x in (src, back))

    def padded(x: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])  # [T + 1, H, D]
        return rows[src].transpose(1, 2)  # [N, H, T_max, D]

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(n * t_max, *out.shape[1:2], out.shape[-1])[back].unsqueeze(0)
