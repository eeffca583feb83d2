"""Attention core for NoPE MLA: scaled-dot-product attention, causal within each packed sequence.

MLA here is standard multi-head attention once the latent is expanded: every
head's key is [k_nope | k_rope], with k_rope shared by all heads and never
rotated (K3 has no rotary embedding). The softmax scale is (nope + rope)^-0.5.

Training rows are long (1-32k tokens), so no path here builds [T, S] scores for them:
- `SegmentCausalMask` says which keys a query sees from per-token positions and sequence ids (query i sees
  key j iff both are in the same sequence and j's position is not after i's), without a [T, S] tensor.
  Plain causal rows, packed rows (`cu_seqlens`) and a context-parallel rank's zigzag queries over the whole
  row's keys are all of this form.
- On CUDA, plain causal and packed rows run torch SDPA with `is_causal` (its memory-efficient backend takes
  MLA's value head size, which differs from the key's); every other case, and every device without fused
  kernels (CPU, meta), runs `blockwise_attention`: an online softmax over query x key blocks whose backward
  recomputes each block's probabilities from the saved log-normalizer, so forward and backward hold
  O(T * block) beyond q, k, v and the output. Key blocks no query of a block may see are skipped.
- Rows of at most `DENSE_MAX_KEYS` keys take the dense SDPA path (one block: the same math, fewer launches).
An explicit bool mask (the reference decode cache's) takes the dense path as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_k3.ops import exact
from miles_k3.ops.kda import _cu_seqlens_bounds

# Query / key block of the blockwise path: [B, H, BLOCK, BLOCK] scores at a time.
BLOCK = 512
# Rows with at most this many keys run dense SDPA (a benchmark raises it to measure the [T, S] baseline).
DENSE_MAX_KEYS = BLOCK


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Bool [q_len, k_len]: query i (the last q_len of k_len positions) sees keys <= its position."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    return torch.arange(k_len, device=device)[None, :] <= q_pos[:, None]


@dataclass(frozen=True)
class SegmentCausalMask:
    """Query i sees key j iff q_seg[i] == k_seg[j] and k_pos[j] <= q_pos[i]. Long tensors q_pos / q_seg [T],
    k_pos / k_seg [S], on the host (block planning reads them; `on(device)` for building block masks there).
    Every query must see at least one key (in every use here it sees itself)."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_seg: torch.Tensor
    k_seg: torch.Tensor

    @classmethod
    def causal(cls, q_len: int, k_len: int) -> "SegmentCausalMask":
        """The last q_len of k_len positions over all k_len keys, one sequence (`causal_mask`)."""
        return cls(
            torch.arange(k_len - q_len, k_len),
            torch.arange(k_len),
            torch.zeros(q_len, dtype=torch.long),
            torch.zeros(k_len, dtype=torch.long),
        )

    @classmethod
    def packed(cls, bounds: list[int]) -> "SegmentCausalMask":
        """A row of sequences [bounds[i], bounds[i+1]) that do not see each other."""
        cu = torch.tensor(bounds)
        pos = torch.arange(int(cu[-1]))
        seg = torch.repeat_interleave(torch.arange(len(bounds) - 1), cu.diff())
        return cls(pos, pos, seg, seg)

    def on(self, device: torch.device | str) -> "SegmentCausalMask":
        """The same mask with its tensors on `device` (one copy each, for building block masks there)."""
        return SegmentCausalMask(*(x.to(device) for x in (self.q_pos, self.k_pos, self.q_seg, self.k_seg)))

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [T, S] (for the dense path and for tests)."""
        return self.on(device).block(slice(None), slice(None))

    def block(self, qs: slice, ks: slice) -> torch.Tensor:
        """Bool [len(qs), len(ks)] on the tensors' device: which of those keys each of those queries sees."""
        return (self.k_pos[None, ks] <= self.q_pos[qs, None]) & (self.k_seg[None, ks] == self.q_seg[qs, None])

    def plan(self, block: int) -> list[tuple[slice, list[slice]]]:
        """(query block, the key blocks any of its queries may see) for blocks of `block` tokens, from each
        block's position and sequence-id ranges (a superset: the block mask decides exactly)."""

        def ranges(pos, seg):
            cuts = [slice(s, min(s + block, len(pos))) for s in range(0, len(pos), block)]
            return [(c, int(pos[c].min()), int(pos[c].max()), int(seg[c].min()), int(seg[c].max())) for c in cuts]

        keys = ranges(self.k_pos, self.k_seg)
        out = []
        for qs, _, q_max, qs_min, qs_max in ranges(self.q_pos, self.q_seg):
            out.append(
                (
                    qs,
                    [
                        ks
                        for ks, k_min, _, ks_min, ks_max in keys
                        if k_min <= q_max and ks_min <= qs_max and qs_min <= ks_max
                    ],
                )
            )
        return out


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class _BlockwiseAttention(torch.autograd.Function):
    """qh [B, H, T, Dqk], kh [B, H, S, Dqk], vh [B, H, S, Dv] -> [B, H, T, Dv] (in v's dtype). Saves q, k, v,
    the output and the log-normalizer [B, H, T]; the backward recomputes each block's probabilities
    exp(s - lse) (flash attention's backward, in torch): exact, no [T, S] tensor."""

    @staticmethod
    def forward(ctx, qh, kh, vh, scale: float, mask: SegmentCausalMask, block: int):
        dt = _compute_dtype(qh)
        b, h, t, _ = qh.shape
        out = qh.new_empty(b, h, t, vh.shape[-1], dtype=dt)
        lse = qh.new_empty(b, h, t, dtype=dt)
        plan, on_device = mask.plan(block), mask.on(qh.device)
        for qs, key_blocks in plan:
            q = qh[:, :, qs].to(dt)
            m = q.new_full(q.shape[:-1], float("-inf"))
            denom = q.new_zeros(q.shape[:-1])
            acc = q.new_zeros(*q.shape[:-1], vh.shape[-1])
            for ks in key_blocks:
                s = (q @ kh[:, :, ks].to(dt).transpose(-1, -2)) * scale
                s = s.masked_fill(~on_device.block(qs, ks), float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows that saw no key yet
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                denom = denom * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + p @ vh[:, :, ks].to(dt)
                m = m_new
            out[:, :, qs] = acc / denom[..., None]
            lse[:, :, qs] = m + denom.log()
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.scale, ctx.mask, ctx.plan = scale, on_device, plan
        return out.to(vh.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qh, kh, vh, out, lse = ctx.saved_tensors
        dt, scale = out.dtype, ctx.scale
        do = grad_out.to(dt)
        delta = (do * out).sum(-1)  # [B, H, T]: rowsum(dO * O) = rowsum(P * dP)
        dq, dk, dv = (torch.zeros(x.shape, dtype=dt, device=x.device) for x in (qh, kh, vh))
        for qs, key_blocks in ctx.plan:
            q, do_q = qh[:, :, qs].to(dt), do[:, :, qs]
            lse_q, delta_q = lse[:, :, qs, None], delta[:, :, qs, None]
            for ks in key_blocks:
                k, v = kh[:, :, ks].to(dt), vh[:, :, ks].to(dt)
                s = (q @ k.transpose(-1, -2)) * scale
                s = s.masked_fill(~ctx.mask.block(qs, ks), float("-inf"))
                p = torch.exp(s - lse_q)
                dv[:, :, ks] += p.transpose(-1, -2) @ do_q
                ds = p * (do_q @ v.transpose(-1, -2) - delta_q) * scale
                dq[:, :, qs] += ds @ k
                dk[:, :, ks] += ds.transpose(-1, -2) @ q
        return dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype), None, None, None


def blockwise_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: SegmentCausalMask, block: int | None = None
) -> torch.Tensor:
    """q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] under `mask` -> [B, T, H, Dv], `block` queries x
    `block` keys at a time (None: `BLOCK`; math in fp32, or fp64 for fp64 inputs; see `_BlockwiseAttention`)."""
    block = BLOCK if block is None else block
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if mask.q_pos.shape[0] != q.shape[1] or mask.k_pos.shape[0] != k.shape[1]:
        raise ValueError(
            f"mask is for {mask.q_pos.shape[0]} queries x {mask.k_pos.shape[0]} keys, got q of "
            f"{q.shape[1]} and k of {k.shape[1]} tokens"
        )
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    return _BlockwiseAttention.apply(qh, kh, vh, float(scale), mask, block).transpose(1, 2)


def _dense(q, k, v, scale, mask: torch.Tensor | None) -> torch.Tensor:
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2)


def mla_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | SegmentCausalMask | None
) -> torch.Tensor:
    """q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] -> [B, T, H, Dv]. `mask`: None for plain causal
    with T == S, a `SegmentCausalMask` (a context-parallel rank's), or a bool tensor broadcastable to
    [B, H, T, S] (True = attend; dense). See the module docstring for which path runs."""
    if exact.enabled():
        return exact.masked_attention(q, k, v, scale, mask)
    if isinstance(mask, torch.Tensor):
        return _dense(q, k, v, scale, mask)
    s = k.shape[1]
    if s <= DENSE_MAX_KEYS:
        return _dense(q, k, v, scale, None if mask is None else mask.dense(q.device))
    if mask is None and q.is_cuda:
        return _dense(q, k, v, scale, None)
    if mask is None:
        if q.shape[1] != s:
            raise ValueError(f"mla_attention without a mask is causal over T == S, got T={q.shape[1]}, S={s}")
        mask = SegmentCausalMask.causal(s, s)
    return blockwise_attention(q, k, v, scale, mask)


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Causal attention within each of the N sequences packed in q [1, T, H, Dqk], k [1, T, H, Dqk],
    v [1, T, H, Dv] (bounds `cu_seqlens` [N+1]). Returns [1, T, H, Dv].

    On CUDA (and for short rows) it runs as one right-padded causal batch [N, H, T_max, .] through SDPA: a
    real query at position i sees keys <= i of its own sequence only, so padding (which comes after) is never
    attended; it costs N T_max^2 instead of the T^2 of a [T, T] segment mask. Elsewhere the blockwise path
    runs over the row itself, skipping the key blocks of other sequences.
    """
    n_tok = q.shape[1]
    bounds = _cu_seqlens_bounds(cu_seqlens, q.shape[0], n_tok)
    if exact.enabled():
        return exact.packed_attention(q, k, v, scale, bounds)
    if not q.is_cuda and n_tok > DENSE_MAX_KEYS:
        return blockwise_attention(q, k, v, scale, SegmentCausalMask.packed(bounds))
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
