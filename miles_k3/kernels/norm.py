"""RMSNorm and sigmoid-gated RMSNorm, one Triton kernel each (the definition: `miles_k3.ops.norm`).

The definition runs an upcast, a square, a mean, an add, an rsqrt, two multiplies and casts: about eight
kernels per norm on CUDA (ten for the gated one). Each kernel here reads its inputs once and writes once.

Contract of `rms_norm(x, weight, eps)` and `gated_rms_norm(x, gate, weight, eps)` (`supports` says which
calls qualify; `miles_k3.ops.norm` sends the others to the definition):
- x [..., D] in fp32 / bf16 / fp16, its last dim contiguous, its leading dims any strides that merge into
  two (`rows.row_layout`); gate of x's shape and layout rules, any of those dtypes; weight [D] contiguous,
  any of those dtypes; all on one device; D <= MAX_D (one row is one block of registers).
- returns a new contiguous [..., D]: rms_norm's in promote_types(weight, x) (the definition's `weight *
  normed.to(x.dtype)`), gated_rms_norm's in x's dtype.
- math as the definition's: rms_norm normalizes in fp32, rounds to x's dtype, then multiplies by the weight
  in fp32 and rounds once to the output dtype (the product of two bf16 / fp16 values is exact in fp32, so
  this is torch's own half-precision multiply); the gated form is normed * weight * sigmoid(gate) in fp32,
  rounded once at the end.
- accuracy: the sum of squares is reduced in another order than torch's (and rsqrt / exp may be the
  device's approximations), so fp32 results are within a few ulps of the definition's. In bf16 / fp16,
  gated_rms_norm's result is within one ulp of the definition's (its fp32 value, a few fp32 ulps off, can
  round to the neighbouring value); rms_norm's normalized x is within one ulp likewise, so its product
  with the weight is within two ulps of x's dtype (a one-ulp step of the normalized value moves the exact
  product by less than two ulps of it at x's precision; rounding both to a grid as fine or finer adds at most
  one more, and grid values less than three ulps apart are at most two apart); with a unit weight, one ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_k3.kernels.rounding import DTYPES, round_to
from miles_k3.kernels.rows import row_layout

MAX_D = 16384
# each program normalizes ROWS rows at once, up to this many elements: short rows (a 128-wide head norm over
# every token's heads) would otherwise leave each program a sliver of work
_TILE = 4096


@triton.jit
def _row_offsets(rows_idx, inner, outer_stride, inner_stride):
    # the element offset of each row's start (rows.row_layout); int64: a strided view may span > 2^31
    r = rows_idx.to(tl.int64)
    return (r // inner) * outer_stride + (r % inner) * inner_stride


@triton.jit
def rms_norm_rows(xf, w_ptr, D, eps, x_dtype: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 rows [ROWS, BLOCK] of an x stored in `x_dtype` (columns past D zero) -> RMSNorm times the weight
    [D] at w_ptr, in fp32 for the caller to round once: the definition's order, normalize in fp32, round to
    x's dtype, then scale by the weight. Shared by `_rms_norm` and AttnRes mixing's norm of its mix."""
    cols = tl.arange(0, BLOCK)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    normed = round_to(xf * rstd[:, None], x_dtype).to(tl.float32)
    return tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :] * normed


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, rows, inner, D, eps, xs0, xs1, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + _row_offsets(r, inner, xs0, xs1)[:, None] + cols[None, :], mask=ok, other=0.0)
    out = round_to(
        rms_norm_rows(x.to(tl.float32), w_ptr, D, eps, x_ptr.dtype.element_ty, BLOCK), out_ptr.dtype.element_ty
    )
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + cols[None, :], out, mask=ok)


@triton.jit
def _gated_rms_norm(
    x_ptr, g_ptr, w_ptr, out_ptr, rows, inner, D, eps, xs0, xs1, gs0, gs1, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (cols < D)[None, :]
    xf = tl.load(x_ptr + _row_offsets(r, inner, xs0, xs1)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + _row_offsets(r, inner, gs0, gs1)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    # fp32 to the end, multiplied in the definition's order
    out = xf * rstd[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + cols[None, :], round_to(out, out_ptr.dtype.element_ty), mask=ok)


def supports(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None = None) -> bool:
    """Whether the kernels take this call (module docstring); else the definition runs."""
    d = x.shape[-1] if x.dim() else 0
    operands = (x,) if gate is None else (x, gate)
    return (
        0 < d <= MAX_D
        and weight.shape == (d,)
        and weight.stride(0) == 1
        and all(t.dtype in DTYPES and t.device == x.device and t.stride(-1) == 1 for t in (*operands, weight))
        and (gate is None or gate.shape == x.shape)
        and row_layout(*operands) is not None
    )


def _launch_shape(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, BLOCK, ROWS, num_warps) for x [..., D]."""
    d = x.shape[-1]
    block = triton.next_power_of_2(d)
    rows_per = max(1, _TILE // block)
    return x.numel() // d, block, rows_per, 8 if block * rows_per >= 8192 else 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> RMSNorm [..., D] in promote_types(weight, x) (module docstring)."""
    assert supports(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows, block, rows_per, warps = _launch_shape(x)
    if rows == 0:
        return out
    inner, ((xs0, xs1),) = row_layout(x)
    _rms_norm[(triton.cdiv(rows, rows_per),)](
        x, weight, out, rows, inner, x.shape[-1], float(eps), xs0, xs1, ROWS=rows_per, BLOCK=block, num_warps=warps
    )
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., D], weight [D] -> RMSNorm(x) * weight * sigmoid(gate) [..., D] in x's dtype."""
    assert supports(x, weight, gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, block, rows_per, warps = _launch_shape(x)
    if rows == 0:
        return out
    inner, ((xs0, xs1), (gs0, gs1)) = row_layout(x, gate)
    _gated_rms_norm[(triton.cdiv(rows, rows_per),)](
        x,
        gate,
        weight,
        out,
        rows,
        inner,
        x.shape[-1],
        float(eps),
        xs0,
        xs1,
        gs0,
        gs1,
        ROWS=rows_per,
        BLOCK=block,
        num_warps=warps,
    )
    return out
