"""Grouped GEMMs over the routed experts' rows: y = x_e @ W_e^T per expert, weights bf16 or packed MXFP4.

Both kernels cut the rows into blocks of BM that never straddle two experts, and each program finds its own
block from the per-expert counts (`_tile`): no schedule is built on the host or by extra launches,
so a MoE layer's GEMMs are its only launches (a schedule in torch ops was eight more a layer).

- `mxfp4_grouped_matmul(xs, counts, packed, scales)`: the weights stay packed MXFP4 and each tile is decoded
  in registers next to the MMA, so the packed bytes (a quarter of bf16's) are all that is read and no bf16
  copy is written (the torch path decodes every expert to bf16 each forward, then `torch._grouped_mm`).
- `grouped_matmul(xs, counts, w)`: bf16 (or fp16) weights. At a decode step's few rows an expert (batch 256
  of k3-small: 16) cuBLAS's grouped GEMM reads the weights at about 1.7 TB/s on the H200; this kernel's
  measured speed and the sizes it is used at are in `supports` and docs/benchmarks.md.

Contract of both:
- xs [M, K]: token copies sorted by expert, `counts[e]` rows for expert e (int64 [E] on the device, sum = M;
  never read on the host, so a call has no host sync and can be captured in a CUDA graph for a fixed M).
  Unit column stride; any row stride.
- weights: w [E, N, K] with unit stride along K; or packed [E, N, K/2] uint8 and scales [E, N, K/32] uint8,
  the layout of `miles_k3.ops.mxfp4` as `quantize_mxfp4` produced it (not validated here), K a multiple of 32.
- returns y [M, N] in xs's dtype, fp32 accumulation, each output rounded once.
- the grid has a static upper bound of blocks, ceil(M / BM) + E (the most any split of M rows over E experts
  needs); programs past the last expert's block exit at once.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None


def default_block_m(num_rows: int, num_experts: int) -> int:
    """Rows per block: 16 when experts get few rows each (decode), else 64."""
    return 16 if num_rows <= 16 * num_experts else 64


# A decode step's shapes, where the bf16 kernel is used (`supports`): up to 32 rows an expert on average
# (batch 512 of k3-small; measured faster than cuBLAS there, docs/benchmarks.md).
MAX_ROWS_PER_EXPERT = 32


def supports(xs: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the engine sends a bf16 expert GEMM to `grouped_matmul` rather than cuBLAS's grouped GEMM: bf16
    or fp16 rows and weights (in fp32 `tl.dot` would round to tf32) and at most MAX_ROWS_PER_EXPERT rows an
    expert on average: decode batches, where this kernel was measured faster (docs/benchmarks.md); prefill's
    larger blocks stay with cuBLAS."""
    return (
        xs.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == xs.dtype
        and xs.shape[0] <= MAX_ROWS_PER_EXPERT * w.shape[0]
    )


if triton is not None:

    @triton.jit
    def _tile(counts_ptr, E, N, BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr):
        """This program's tile: (expert, its rows, which of them are real, its columns, which are in range).
        program_id(0) is a block of BM rows of one expert (expert >= E past the last block: expert e owns
        blocks [cum[e] - blocks[e], cum[e]) of ceil(counts / BM)); program_id(1) a block of BN columns."""
        b = tl.program_id(0)
        i = tl.arange(0, BE)
        counts = tl.load(counts_ptr + i, mask=i < E, other=0).to(tl.int32)
        blocks = (counts + BM - 1) // BM
        cum = tl.cumsum(blocks, axis=0)
        ends = tl.cumsum(counts, axis=0)
        e = tl.sum((cum <= b).to(tl.int32), axis=0)  # cum is nondecreasing: the first expert ending past b
        mine = i == e
        first_block = tl.sum(tl.where(mine, cum - blocks, 0), axis=0)
        row0 = tl.sum(tl.where(mine, ends - counts, 0), axis=0) + (b - first_block) * BM
        rows = row0 + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        return e, rows, rows < tl.sum(tl.where(mine, ends, 0), axis=0), cols, cols < N

    @triton.jit
    def _grouped_gemm(
        x_ptr,
        w_ptr,
        y_ptr,
        counts_ptr,
        E,
        N,
        K,
        stride_xm,
        stride_we,
        stride_wn,
        stride_ym,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        BE: tl.constexpr,
    ):
        e, rows, row_ok, cols, col_ok = _tile(counts_ptr, E, N, BM, BN, BE)
        if e < E:
            w_rows = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                k_ok = ks < K
                x = tl.load(
                    x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.dot(x, tl.trans(w))
            _store(y_ptr, acc, rows, row_ok, cols, col_ok, stride_ym)

    @triton.jit
    def _mxfp4_grouped_gemm(
        x_ptr,
        packed_ptr,
        scale_ptr,
        y_ptr,
        counts_ptr,
        E,
        N,
        K,
        stride_xm,
        stride_pe,
        stride_pn,
        stride_se,
        stride_sn,
        stride_ym,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        BE: tl.constexpr,
    ):
        e, rows, row_ok, cols, col_ok = _tile(counts_ptr, E, N, BM, BN, BE)
        if e < E:
            e64 = e.to(tl.int64)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                x = tl.load(
                    x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=row_ok[:, None], other=0.0
                )
                kb = k0 // 2 + tl.arange(0, BK // 2)
                p = tl.load(
                    packed_ptr + e64 * stride_pe + cols[:, None] * stride_pn + kb[None, :],
                    mask=col_ok[:, None],
                    other=0,
                )
                # element 2j is the low nibble of byte j, element 2j + 1 the high one
                codes = tl.reshape(tl.join(p & 0xF, p >> 4), (BN, BK))
                mag = (codes & 7).to(tl.int32)
                exp = mag >> 1
                man = (mag & 1).to(tl.float32)
                # E2M1: exponent 0 is subnormal (0 or 0.5); otherwise (1 + man / 2) * 2^(exp - 1)
                val = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
                val = tl.where((codes & 8) != 0, -val, val)
                sb = k0 // 32 + tl.arange(0, BK // 32)
                s = tl.load(
                    scale_ptr + e64 * stride_se + cols[:, None] * stride_sn + sb[None, :],
                    mask=col_ok[:, None],
                    other=127,
                )
                scale = tl.exp2(s.to(tl.float32) - 127.0)
                w = tl.reshape(tl.reshape(val, (BN, BK // 32, 32)) * scale[:, :, None], (BN, BK))
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
            _store(y_ptr, acc, rows, row_ok, cols, col_ok, stride_ym)

    @triton.jit
    def _store(y_ptr, acc, rows, row_ok, cols, col_ok, stride_ym):
        out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _rows(xs: torch.Tensor) -> torch.Tensor:
    return xs if xs.stride(1) == 1 else xs.contiguous()


def grouped_matmul(
    xs: torch.Tensor,
    counts: torch.Tensor,
    w: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """See the module docstring (bf16 weights). block_m: rows per block (default `default_block_m`); the tile
    and launch settings are for the benchmark's sweeps (scripts/bench_decode_kernels.py)."""
    if triton is None:
        raise RuntimeError("grouped_matmul needs triton")
    m, k = xs.shape
    e, n, wk = w.shape
    assert wk == k and counts.shape == (e,) and w.stride(2) == 1, (tuple(xs.shape), tuple(w.shape))
    xs = _rows(xs)
    y = torch.empty(m, n, dtype=xs.dtype, device=xs.device)
    if m == 0:
        return y
    bm = block_m or default_block_m(m, e)
    grid = (triton.cdiv(m, bm) + e, triton.cdiv(n, block_n))
    _grouped_gemm[grid](
        xs,
        w,
        y,
        counts,
        e,
        n,
        k,
        xs.stride(0),
        w.stride(0),
        w.stride(1),
        y.stride(0),
        BM=bm,
        BN=block_n,
        BK=block_k,
        BE=triton.next_power_of_2(e),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def mxfp4_grouped_matmul(
    xs: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *, block_m: int | None = None
) -> torch.Tensor:
    """See the module docstring (MXFP4 weights). block_m: rows per block (default `default_block_m`)."""
    if triton is None:
        raise RuntimeError("mxfp4_grouped_matmul needs triton")
    m, k = xs.shape
    e, n, half_k = packed.shape
    assert half_k * 2 == k and k % 32 == 0, f"x [{m}, {k}] does not match packed {tuple(packed.shape)}"
    assert scales.shape == (e, n, k // 32) and counts.shape == (e,), (tuple(scales.shape), tuple(counts.shape))
    xs, packed, scales = _rows(xs), packed.contiguous(), scales.contiguous()
    y = torch.empty(m, n, dtype=xs.dtype, device=xs.device)
    if m == 0:
        return y
    bm = block_m or default_block_m(m, e)
    bn, bk = 64, 64 if k % 64 == 0 else 32
    grid = (triton.cdiv(m, bm) + e, triton.cdiv(n, bn))
    _mxfp4_grouped_gemm[grid](
        xs,
        packed,
        scales,
        y,
        counts,
        e,
        n,
        k,
        xs.stride(0),
        packed.stride(0),
        packed.stride(1),
        scales.stride(0),
        scales.stride(1),
        y.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        BE=triton.next_power_of_2(e),
    )
    return y
