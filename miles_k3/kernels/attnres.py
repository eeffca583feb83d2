"""Attention Residuals mixing in one Triton kernel (the definition: `miles_k3.ops.attnres.attn_res_mix`).

The definition stacks the L sources, upcasts them, normalizes each as a key, takes its dot with the query,
softmaxes over L and sums the weighted values: about fifteen kernels per call on CUDA, and the stack copies
every source. Here the sources come in as a tuple of pointers (the count is a compile-time constant, so each
count K3 uses compiles once and there is no stack), and each program reads each of its rows' sources once,
folding it into an online softmax (running max, denominator and weighted sum in fp32 registers).

Contract of `attn_res_mix(h, blocks, norm_weight, proj_weight, eps)` (`supports` says which calls qualify;
`miles_k3.ops.attnres` sends the others to the definition):
- h and every block [..., D] of one shape and one dtype (fp32 / bf16 / fp16), each last dim contiguous, the
  leading dims any strides that merge into two for all of them (`rows.row_layout`); at most MAX_SOURCES
  sources (len(blocks) + 1; K3 has at most ceil(93 / 12) + 1 = 9); norm_weight [D] and proj_weight [1, D]
  contiguous rows, fp32 / bf16 / fp16; one device; D <= MAX_D.
- returns a new contiguous [..., D] in h's dtype; the sources in the definition's order (blocks, then h).
- math as the definition's, in fp32: logit_i = (v_i . q) * rsqrt(mean(v_i^2) + eps) with q = norm_weight *
  proj_weight[0] (the key's scale taken out of the dot: the same sum up to rounding), out = sum_i
  softmax(logit)_i v_i.
- accuracy: the reduction orders and the online rescaling differ from the definition's. A logit rounds to
  within a few u * lam (u = 2^-24, lam = max_i sum_j |k_ij q_j|, the dot's condition), which moves each p_i
  by that relative amount, so in fp32 |out - definition| <= 4 u (1 + lam) sum_i p_i |v_i| (the sum's
  magnitude, not |out|, which may be smaller where values cancel); the tests hold this bound, reached to
  about half. In bf16 / fp16, within one ulp of the definition's rounded result beyond that.

`add_attn_res_mix(h, add, blocks, ...)` first adds `add` (h's shape and dtype, any strides that merge with the
sources') to h, rounded to h's dtype as torch's add is, and returns that sum with the mix over blocks and it:
the layer's residual add before its second mixing site, in the same launch (bit for bit the definition's sum).

With `then_norm` = (weight, eps) the kernel returns the RMSNorm of that mix instead (the layer's norm of its
mixed input: `miles_k3.ops.attnres.attn_res_mix_rms_norm`), one launch for two: the mix rounded to h's dtype
as it would be stored, then `norm._rms_norm`'s math on it (normalize in fp32, round to h's dtype, times the
weight, rounded once to promote_types(weight, h)); so within `norm`'s bounds of the norm of the mix above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from miles_k3.kernels import norm as norm_kernels
from miles_k3.kernels.norm import rms_norm_rows
from miles_k3.kernels.rounding import DTYPES, round_to
from miles_k3.kernels.rows import row_layout

MAX_SOURCES = 16
MAX_D = 16384
_ROW_TILE = 1024  # elements per program (short rows get several per program)


@triton.jit
def _attn_res_mix(
    srcs,
    outer_strides,
    inner_strides,
    nw_ptr,
    pw_ptr,
    out_ptr,
    ow_ptr,
    hout_ptr,
    rows,
    inner,
    D,
    eps,
    oeps,
    L: tl.constexpr,
    NORM: tl.constexpr,
    ADD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (cols < D)[None, :]
    q = tl.load(nw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32) * tl.load(
        pw_ptr + cols, mask=cols < D, other=0.0
    ).to(tl.float32)
    r64 = r.to(tl.int64)
    outer, within = r64 // inner, r64 % inner
    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max of the logits
    s = tl.zeros([ROWS], tl.float32)  # running softmax denominator, relative to m
    acc = tl.zeros([ROWS, BLOCK], tl.float32)  # running weighted sum, relative to m
    for i in tl.static_range(L):
        start = outer * outer_strides[i] + within * inner_strides[i]
        v = tl.load(srcs[i] + start[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if ADD and i == L - 1:  # h + add (srcs[L]) first, rounded to h's dtype as torch's add is, and stored
            at = outer * outer_strides[L] + within * inner_strides[L]
            a = tl.load(srcs[L] + at[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            v = round_to(v + a, srcs[i].dtype.element_ty).to(tl.float32)
            tl.store(hout_ptr + r64[:, None] * D + cols[None, :], round_to(v, hout_ptr.dtype.element_ty), mask=ok)
        # masked rows / columns load zeros: a finite logit (0), never a NaN
        logit = tl.sum(v * q[None, :], axis=1) * tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        m_new = tl.maximum(m, logit)
        scale = tl.exp(m - m_new)  # exp(-inf) = 0 for the first source
        p = tl.exp(logit - m_new)
        s = s * scale + p
        acc = acc * scale[:, None] + p[:, None] * v
        m = m_new
    out = acc / s[:, None]
    if NORM:  # then the RMSNorm the layer applies to the mix, as `norm._rms_norm` computes it on the stored mix
        mixed = round_to(out, srcs[0].dtype.element_ty).to(tl.float32)
        out = rms_norm_rows(mixed, ow_ptr, D, oeps, srcs[0].dtype.element_ty, BLOCK)
    tl.store(out_ptr + r64[:, None] * D + cols[None, :], round_to(out, out_ptr.dtype.element_ty), mask=ok)


def supports(
    h: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    then_norm: tuple[torch.Tensor, float] | None = None,
    add: torch.Tensor | None = None,
) -> bool:
    """Whether the kernel takes this call (module docstring); else the definition runs."""
    sources = (*blocks, h) + ((add,) if add is not None else ())
    d = h.shape[-1] if h.dim() else 0
    if then_norm is not None and not norm_kernels.supports(h, then_norm[0]):
        return False
    return (
        0 < d <= MAX_D
        and len(blocks) + 1 <= MAX_SOURCES
        and h.dtype in DTYPES
        and all(
            t.shape == h.shape and t.dtype == h.dtype and t.device == h.device and t.stride(-1) == 1 for t in sources
        )
        and norm_weight.shape == (d,)
        and proj_weight.shape == (1, d)
        and all(w.dtype in DTYPES and w.device == h.device and w.stride(-1) == 1 for w in (norm_weight, proj_weight))
        and row_layout(*sources) is not None
    )


def attn_res_mix(
    h: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
    then_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """h and each block [..., D] -> the softmax-weighted mix of blocks + [h], [..., D] in h's dtype; with
    `then_norm` (weight [D], eps), that mix's RMSNorm instead (module docstring)."""
    assert supports(h, blocks, norm_weight, proj_weight, then_norm)
    return _launch(h, blocks, norm_weight, proj_weight, eps, then_norm, None)[1]


def add_attn_res_mix(
    h: torch.Tensor,
    add: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
    then_norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + add, `attn_res_mix` over blocks + [h + add]) in one launch: the sum rounded to h's dtype as
    torch's add rounds it (so bit for bit the definition's), then mixed as that (module docstring)."""
    assert supports(h, blocks, norm_weight, proj_weight, then_norm, add)
    return _launch(h, blocks, norm_weight, proj_weight, eps, then_norm, add)


def _launch(h, blocks, norm_weight, proj_weight, eps, then_norm, add) -> tuple[torch.Tensor | None, torch.Tensor]:
    sources = (*blocks, h) + ((add,) if add is not None else ())
    dtype = h.dtype if then_norm is None else torch.promote_types(then_norm[0].dtype, h.dtype)
    out = torch.empty(h.shape, dtype=dtype, device=h.device)
    h_out = torch.empty(h.shape, dtype=h.dtype, device=h.device) if add is not None else None
    d = h.shape[-1]
    rows = h.numel() // d
    if rows == 0:
        return h_out, out
    inner, strides = row_layout(*sources)
    block = triton.next_power_of_2(d)
    # a program per row from 1,024 wide (k3-small on the H200: 3.6 / 4.3 us at batch 1 / 256 and five sources,
    # against 4.7 / 5.1 for four rows a program at 8 warps, bench_decode_kernels.py); narrower rows share one
    rows_per = max(1, _ROW_TILE // block)
    _attn_res_mix[(triton.cdiv(rows, rows_per),)](
        sources,
        tuple(s for s, _ in strides),
        tuple(s for _, s in strides),
        norm_weight,
        proj_weight,
        out,
        norm_weight if then_norm is None else then_norm[0],
        out if h_out is None else h_out,
        rows,
        inner,
        d,
        float(eps),
        0.0 if then_norm is None else float(then_norm[1]),
        L=len(blocks) + 1,
        NORM=then_norm is not None,
        ADD=add is not None,
        ROWS=rows_per,
        BLOCK=block,
        # a 7168-wide row holds the running sum, a source and the query: at 8 warps ptxas (sm_90, L = 9) spilled
        # 400 bytes a thread, at 16 240 (its prefetched loads)
        num_warps=min(16, max(4, block * rows_per // 256)),
    )
    return h_out, out
