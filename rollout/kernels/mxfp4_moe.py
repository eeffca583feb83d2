"""Grouped GEMM over routed experts whose weights stay packed MXFP4: y = x_e @ W_e^T per expert block.

The torch path decodes every expert's weights to a bf16 copy each forward and then runs
`torch._grouped_mm`; this kernel decodes each weight tile in registers next to the MMA, so the packed
bytes (a quarter of bf16's) are all that is read from memory and no copy is written.

Contract of `mxfp4_grouped_matmul(xs, counts, packed, scales)`:
- xs [M, K] (bf16 on CUDA): token copies sorted by expert, `counts[e]` rows for expert e (int64 [E],
  on the device, sum = M; never read on the host, so the call has no host sync and can be captured
  in a CUDA graph for a fixed M).
- packed [E, N, K/2] uint8 and scales [E, N, K/32] uint8: the layout of `miles_k3.ops.mxfp4`, as
  `quantize_mxfp4` produced it (not validated here); K a multiple of 32.
- returns y [M, N] in xs's dtype, fp32 accumulation.

Work is cut into blocks of BM rows that never straddle two experts (`block_schedule`); the grid has a
static upper bound of blocks (ceil(M / BM) + E), and blocks past the last expert exit at once.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None


def block_schedule(counts: torch.Tensor, num_rows: int, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_expert [B] int32, -1 past the last block; block_row [B] int32, first row of the block;
    expert_end [E] int32, one past each expert's last row) with B = ceil(num_rows / block_m) + E, the
    most blocks any split of num_rows rows over E experts needs. Device ops only."""
    e = counts.numel()
    blocks = (counts + block_m - 1) // block_m
    cum_blocks = blocks.cumsum(0)
    ends = counts.cumsum(0)
    b = torch.arange(-(-num_rows // block_m) + e, device=counts.device)
    expert = torch.searchsorted(cum_blocks, b, right=True)
    owner = expert.clamp(max=e - 1)
    row = ends[owner] - counts[owner] + (b - (cum_blocks[owner] - blocks[owner])) * block_m
    block_expert = torch.where(expert < e, expert, torch.full_like(expert, -1))
    return block_expert.to(torch.int32), row.to(torch.int32), ends.to(torch.int32)


if triton is not None:

    @triton.jit
    def _mxfp4_grouped_gemm(x_ptr, packed_ptr, scale_ptr, y_ptr, block_expert_ptr, block_row_ptr, expert_end_ptr,
                            N, K, stride_xm, stride_pe, stride_pn, stride_se, stride_sn, stride_ym,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        e = tl.load(block_expert_ptr + tl.program_id(0))
        if e >= 0:
            row0 = tl.load(block_row_ptr + tl.program_id(0))
            row_end = tl.load(expert_end_ptr + e)
            rows = row0 + tl.arange(0, BM)
            row_ok = rows < row_end
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            col_ok = cols < N
            e64 = e.to(tl.int64)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=row_ok[:, None],
                            other=0.0)
                kb = k0 // 2 + tl.arange(0, BK // 2)
                p = tl.load(packed_ptr + e64 * stride_pe + cols[:, None] * stride_pn + kb[None, :],
                            mask=col_ok[:, None], other=0)
                # element 2j is the low nibble of byte j, element 2j + 1 the high one
                codes = tl.reshape(tl.join(p & 0xF, p >> 4), (BN, BK))
                mag = (codes & 7).to(tl.int32)
                exp = mag >> 1
                man = (mag & 1).to(tl.float32)
                # E2M1: exponent 0 is subnormal (0 or 0.5); otherwise (1 + man / 2) * 2^(exp - 1)
                val = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
                val = tl.where((codes & 8) != 0, -val, val)
                sb = k0 // 32 + tl.arange(0, BK // 32)
                s = tl.load(scale_ptr + e64 * stride_se + cols[:, None] * stride_sn + sb[None, :],
                            mask=col_ok[:, None], other=127)
                scale = tl.exp2(s.to(tl.float32) - 127.0)
                w = tl.reshape(tl.reshape(val, (BN, BK // 32, 32)) * scale[:, :, None], (BN, BK))
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
            out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def default_block_m(num_rows: int, num_experts: int) -> int:
    """Rows per block: 16 when experts get few rows each (decode), else 64."""
    return 16 if num_rows <= 16 * num_experts else 64


def mxfp4_grouped_matmul(xs: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                         *, block_m: int | None = None, schedule: tuple | None = None) -> torch.Tensor:
    """See the module docstring. block_m: rows per block (default `default_block_m`). schedule:
    `block_schedule(counts, M, block_m)` with the same block_m, for callers that run several GEMMs over
    the same rows (an expert's w1, w3, w2) and build it once."""
    if triton is None:
        raise RuntimeError("mxfp4_grouped_matmul needs triton")
    m, k = xs.shape
    e, n, half_k = packed.shape
    assert half_k * 2 == k and k % 32 == 0, f"x [{m}, {k}] does not match packed {tuple(packed.shape)}"
    assert scales.shape == (e, n, k // 32) and counts.shape == (e,), (tuple(scales.shape), tuple(counts.shape))
    xs, packed, scales = xs.contiguous(), packed.contiguous(), scales.contiguous()
    y = torch.empty(m, n, dtype=xs.dtype, device=xs.device)
    if m == 0:
        return y
    bm = block_m or default_block_m(m, e)
    block_expert, block_row, expert_end = schedule or block_schedule(counts, m, bm)
    bn, bk = 64, 64 if k % 64 == 0 else 32
    grid = (block_expert.numel(), triton.cdiv(n, bn))
    _mxfp4_grouped_gemm[grid](xs, packed, scales, y, block_expert, block_row, expert_end, n, k,
                              xs.stride(0), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
                              y.stride(0), BM=bm, BN=bn, BK=bk)
    return y
