"""KDA's recurrence over a few tokens per row, from states kept in a pool: the engine's decode step, the
speculative verify and the speculative fold, one kernel.

fla's recurrent kernel (`fla.ops.kda.fused_recurrent`) in its continuous-batching mode reads a row's state
from a pool slot but writes the state after every token (to a slot per token): for the verify forward,
which may not write the committed state at all, and for the fold, which only needs the last one, that is
T writes of the whole state where zero or one will do (k3-small: 6.5 MB of KDA state a row, so by
arithmetic 1.7 GB a write at batch 256). The speculative verify ran fla's chunked kernel instead, over gathered copies
of the states, and returned a final state nobody kept: five to six passes over the states a step.

Contract of `kda_rows(q, k, v, g, beta, pool, index, scale, use_qk_l2norm, write, cu_seqlens)`:
- q, k, g [N, T, H, K], v [N, T, H, V], beta [N, T, H]: the gate `g` already applied (log-decay, fp32, as
  `miles_k3.ops.kda.kda_gate` gives it) and `beta` the write strength (not a logit). Or packed rows [1, total,
  ...] with cu_seqlens [N+1] (row n's tokens cu[n]..cu[n+1]-1). Any float dtypes; contiguous copies are taken.
- pool [slots, H, K, V] fp32, each slot contiguous (any slot stride); index [N] int64: row n starts from
  pool[index[n]].
- returns o [N, T, H, V] in v's dtype; with `write`, row n's state after its last token is stored back into
  pool[index[n]] (rows sharing a slot leave it undefined: the engine's padding rows on its sink). Without
  `write` the pool is only read.
- per token, the arithmetic of fla's recurrent kernel for these options (L2-normed q and k when asked,
  q scaled, the state decayed by exp(g), the delta-rule write, o = S^T q), in fp32 registers, with its tiling
  (the whole K per program, V in blocks of 32): so a row's state after T tokens in one call is the state T
  single-token calls leave, bit for bit (the same loop body, run T times), which is what lets the fold
  commit exactly the state plain decoding would have. A token with g = 0 and beta = 0 leaves the state bit
  for bit (decay exp(0) = 1, a zero write): the fold's masked tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BV = 32  # fla's V block for this kernel


@triton.jit(do_not_specialize=["T"])
def _kda_rows(
    q,
    k,
    v,
    g,
    beta,
    o,
    pool,
    index,
    cu_seqlens,
    T,
    stride_slot,
    scale: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    WRITE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v = pid % NV
    i_nh = pid // NV
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * H + i_h) * V + o_v
    p_g = g + (bos * H + i_h) * K + o_k
    p_beta = beta + bos * H + i_h
    p_o = o + (bos * H + i_h) * V + o_v
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]

    slot = tl.load(index + i_n).to(tl.int64)
    p_h = pool + slot * stride_slot + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_h += tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
    for _ in tl.range(0, T, num_stages=2):
        b_q = tl.load(p_q, mask=mask_k, other=0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        b_g = tl.load(p_g, mask=mask_k, other=0).to(tl.float32)
        b_h *= tl.exp(b_g[:, None])
        b_v -= tl.sum(b_h * b_k[:, None], 0)
        b_beta = tl.load(p_beta).to(tl.float32)
        b_v *= b_beta
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
        p_q += H * K
        p_k += H * K
        p_v += H * V
        p_g += H * K
        p_o += H * V
        p_beta += H
    if WRITE:
        tl.store(p_h, b_h, mask=mask_h)


def supports(q: torch.Tensor, v: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether `kda_rows` takes these operands: an fp32 pool with contiguous slots shaped [H, K, V] for q / v."""
    return (
        pool.dtype == torch.float32
        and pool[0].is_contiguous()
        and q.dim() == 4
        and pool.shape[1:] == (q.shape[2], q.shape[3], v.shape[3])
    )


def kda_rows(
    q,
    k,
    v,
    g,
    beta,
    pool: torch.Tensor,
    index: torch.Tensor,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
    write: bool,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The module docstring's contract."""
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    if index.shape != (n,):
        raise ValueError(f"index {tuple(index.shape)} does not fit {n} rows")
    scale = kd**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    if n == 0 or t == 0:
        return o
    grid = (triton.cdiv(vd, BV) * n * h,)
    _kda_rows[grid](
        q,
        k,
        v,
        g,
        beta,
        o,
        pool,
        index,
        cu_seqlens,
        t,
        pool.stride(0),
        scale=scale,
        H=h,
        K=kd,
        V=vd,
        BK=triton.next_power_of_2(kd),
        BV=BV,
        L2NORM=use_qk_l2norm,
        WRITE=write,
        IS_VARLEN=cu_seqlens is not None,
        num_warps=4,
    )
    return o
