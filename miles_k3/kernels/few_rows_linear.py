"""y = x W^T for a few rows of x (a decode step at batch 1-4): one Triton kernel that streams W once.

At batch 1 the engine's step is ~100 linears of 0.25-8 MB, and cuBLAS runs each as a GEMM tile of at least
8 rows: 4-8 us a call on the H200 for a 1024 x 1024 bf16 weight that the bandwidth would read in 0.5 us
(2026-12-04, `scripts/bench_decode_kernels.py`). Here a program owns BN output features, walks K in BK-wide
chunks reading its [BN, BK] tile of W once for all rows, and keeps the products in fp32 registers until one
reduction at the end: thousands of small programs, so the weight streams at close to the copy bandwidth.

Contract of `linear(x, weight, out_dtype)` (`fits` says which calls it computes, `supports` which of those
it computes faster than cuBLAS; callers run `F.linear` otherwise):
- x [..., K] whose leading dims hold at most MAX_ROWS rows and view as [rows, K] with a unit last stride;
  weight [N, K] with a unit last stride (rows of a larger weight are fine); each fp32 / bf16 / fp16; one
  device.
- returns a new contiguous [..., N] in `out_dtype` (default x's dtype): y[m, n] = sum_k float(x[m, k]) *
  float(weight[n, k]) in fp32, rounded once (`rounding.round_to`). So F.linear's value for bf16 / fp16 (fp32
  accumulation, one rounding) and `F.linear(x.float(), weight.float())`'s for an fp32 output (the router's
  logits, without the upcast copy), up to the order of the K-sum: within K * u * sum_k |x_k w_k| (u = 2^-24)
  before the final rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_k3.kernels.rounding import DTYPES, round_to

# Where it beats cuBLAS (bench_decode_kernels.py, H200, 2026-12-04): 1 x 1024 -> 1024 in 2.5 us against 7.6,
# 4 rows of it 4.4 against 5.3; but 2 x 1024 -> 4232 5.2 against 4.1 and the 1 x 1024 -> 163,840 lm_head 93
# against 81 (its registers hold every row's partial products: more rows, fewer programs in flight). So at
# most MAX_ROWS rows and rows x weight elements at most MAX_WORK.
MAX_ROWS = 4
MAX_WORK = 1 << 22
_TILE = 2048  # elements of one program's fp32 accumulator (rows x BN x BK): 16 registers a thread at 4 warps


@triton.jit
def _few_rows_linear(x_ptr, w_ptr, y_ptr, M, N, K, sx, sw, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, MB)
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros([MB, BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    tl.store(
        y_ptr + m[:, None] * N + n[None, :], round_to(y, y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :]
    )


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def fits(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> bool:
    """Whether `linear` can compute this call: the contract's shapes, layouts and dtypes, any amount of work."""
    if x.dim() == 0 or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or x.shape[-1] == 0:
        return False
    if not 1 <= rows_of(x) <= MAX_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return False
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims that do not collapse to one row stride
        return False
    return (
        x.dtype in DTYPES and weight.dtype in DTYPES and (out_dtype or x.dtype) in DTYPES and x.device == weight.device
    )


def supports(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> bool:
    """Whether callers should run this call here rather than in cuBLAS: it `fits` and rows x N x K is at most
    MAX_WORK."""
    return fits(x, weight, out_dtype) and rows_of(x) * weight.numel() <= MAX_WORK


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] (`fits`), weight [N, K] -> x W^T [..., N] in `out_dtype` (module docstring)."""
    assert fits(x, weight, out_dtype)
    rows = x.view(-1, x.shape[-1])
    m, k = rows.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    mb = triton.next_power_of_2(m)
    bk = min(triton.next_power_of_2(k), 512 // mb)
    bn = _TILE // (mb * bk)
    _few_rows_linear[(triton.cdiv(n, bn),)](
        rows, weight, y, m, n, k, rows.stride(0), weight.stride(0), MB=mb, BN=bn, BK=bk, num_warps=4
    )
    return y.view(*x.shape[:-1], n)
