"""LoRA term for a batch whose rows use different adapters: y[i] += scale[i] * B[w_i] (A[w_i] x[i]).

Each row names its adapter's weights by an index into stacked A / B (an adapter slot, or slot * E + expert
for routed experts), read on the device: no host sync, no per-adapter loop and no gathered copy of the
weights, so one launch pair serves any mix of adapters and can be captured in a CUDA graph. The torch path
it replaces (`AdapterPool._mixed_delta`) loops over the slots present, which needs the slot list on the
host.

Contract of `lora_rows_(y, x, a, b, index, row_scale)`:
- x [N, IN], y [N, OUT] (same dtype, on the same device); y is updated in place and returned.
- a [K, R, IN], b [K, OUT, R] in any float dtype, each [R, IN] / [OUT, R] matrix contiguous.
- index int [N] on the device: the matrix pair of each row; a negative index leaves the row unchanged.
- row_scale fp32 [N] on the device: each row's alpha / rank.
Accumulation is fp32; the down-projection A x is kept in fp32 (not rounded to the weights' dtype).

Two kernels, one program per row (and per OUT block for the up-projection): the rank is small (8-64), so
the work is two matrix-vector products per row, done with reductions rather than tensor-core tiles. For
decode batches that is what a row costs anyway; prefill-sized batches of one adapter take the engine's
grouped path instead.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None


if triton is not None:

    @triton.jit
    def _lora_down(
        x_ptr,
        a_ptr,
        index_ptr,
        h_ptr,
        IN,
        stride_x,
        stride_ak,
        stride_ar,
        stride_h,
        R: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
    ):
        row = tl.program_id(0)
        w = tl.load(index_ptr + row).to(tl.int64)
        rs = tl.arange(0, BR)
        acc = tl.zeros((BR,), dtype=tl.float32)
        if w >= 0:
            for k0 in range(0, IN, BK):
                ks = k0 + tl.arange(0, BK)
                k_ok = ks < IN
                xk = tl.load(x_ptr + row.to(tl.int64) * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = tl.load(
                    a_ptr + w * stride_ak + rs[:, None] * stride_ar + ks[None, :],
                    mask=(rs[:, None] < R) & k_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(h_ptr + row.to(tl.int64) * stride_h + rs, acc, mask=rs < R)

    @triton.jit
    def _lora_up(
        h_ptr,
        b_ptr,
        index_ptr,
        scale_ptr,
        y_ptr,
        OUT,
        stride_h,
        stride_bk,
        stride_bo,
        stride_y,
        R: tl.constexpr,
        BR: tl.constexpr,
        BN: tl.constexpr,
    ):
        row = tl.program_id(0)
        w = tl.load(index_ptr + row).to(tl.int64)
        if w >= 0:
            rs = tl.arange(0, BR)
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            col_ok = cols < OUT
            h = tl.load(h_ptr + row.to(tl.int64) * stride_h + rs, mask=rs < R, other=0.0)
            b = tl.load(
                b_ptr + w * stride_bk + cols[:, None] * stride_bo + rs[None, :],
                mask=col_ok[:, None] & (rs[None, :] < R),
                other=0.0,
            ).to(tl.float32)
            delta = tl.sum(b * h[None, :], axis=1) * tl.load(scale_ptr + row)
            out = y_ptr + row.to(tl.int64) * stride_y + cols
            y = tl.load(out, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def lora_rows_(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, row_scale: torch.Tensor
) -> torch.Tensor:
    """See the module docstring."""
    if triton is None:
        raise RuntimeError("lora_rows_ needs triton")
    n, in_features = x.shape
    k, rank, a_in = a.shape
    assert a_in == in_features and b.shape[0] == k and b.shape[2] == rank, (tuple(a.shape), tuple(b.shape))
    out_features = b.shape[1]
    assert y.shape == (n, out_features) and index.shape == (n,) and row_scale.shape == (n,)
    assert a.stride(2) == 1 and b.stride(2) == 1 and x.stride(1) == 1 and y.stride(1) == 1
    if n == 0:
        return y
    h = torch.empty(n, rank, dtype=torch.float32, device=x.device)
    br = triton.next_power_of_2(rank)
    _lora_down[(n,)](
        x, a, index, h, in_features, x.stride(0), a.stride(0), a.stride(1), h.stride(0), R=rank, BR=br, BK=128
    )
    bn = 64
    _lora_up[(n, triton.cdiv(out_features, bn))](
        h,
        b,
        index,
        row_scale,
        y,
        out_features,
        h.stride(0),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        R=rank,
        BR=br,
        BN=bn,
    )
    return y
