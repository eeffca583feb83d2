"""The routed experts' dispatch and combine around their grouped GEMMs: two kernels instead of about ten.

The torch definition (`miles_k3.model.moe.RoutedExperts.forward`) sorts the N * k (token, expert) pairs by
expert (a stable argsort), divides for each copy's token, counts rows per expert (zeros and a scatter-add),
gathers the weights in sorted order, weighs the expert outputs and adds them back per token (zeros and an
index_add_): about ten kernels a MoE layer on CUDA, each on a few hundred integers or rows at decode.

Contracts (`supports` says which calls qualify; `RoutedExperts.forward` sends the others to the definition):
- `align(indices, num_experts)`: indices [N, k] int64 contiguous, entries in [0, num_experts), N * k <=
  MAX_PAIRS -> (token_of [N * k] int64, counts [num_experts] int64, pos [N * k] int64). The
  sorted order is the definition's stable argsort of the flattened indices (sorting expert * BM + position,
  which breaks ties by position), so token_of and counts are the definition's exactly; pos is its inverse
  (pair t * k + j sits at sorted row pos[t * k + j]), which the combine reads instead of scattering.
- `combine(ys, weights, pos, dtype)`: ys [N * k, D] (rows in sorted order, row stride any, unit column
  stride), weights [N, k] contiguous fp32, pos from `align` -> out [N, D] in `dtype`: out[t] = sum over j
  of round(weights[t, j] * ys[pos[t * k + j]]), each product rounded to `dtype` as the definition's weighted
  rows are, the sum in fp32 over j in order and rounded once. The definition adds the rounded rows into a
  `dtype` output one at a time (CUDA's atomics pick the order), so in bf16 the two differ by the
  definition's own rounding of its partial sums; in fp32 by a few ulps of the largest term.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_k3.kernels.rounding import DTYPES, round_to

MAX_PAIRS = 16384  # K3's 1,024 decode rows x top-16
MAX_EXPERTS = 4095  # the histogram's bins, one kept for the padding lanes
SORT_PAIRS = 256  # up to this many pairs `align` sorts in one program; more go by blocks
ALIGN_BLOCK = 128  # pairs per program of the blocked align


@triton.jit
def _align(idx_ptr, token_ptr, pos_ptr, counts_ptr, M, K, E, BM: tl.constexpr, BE: tl.constexpr):
    i = tl.arange(0, BM)
    ok = i < M
    e = tl.load(idx_ptr + i, mask=ok, other=0)
    e = tl.where(ok, e, E)  # padding lanes: past every expert, so they sort last and count in an unused bin
    order = tl.sort(e.to(tl.int64) * BM + i) % BM  # stable: equal experts keep their positions' order
    tl.store(token_ptr + i, order // K, mask=ok)
    tl.store(pos_ptr + order, i.to(tl.int64), mask=ok)  # the first M sorted entries are the real pairs
    counts = tl.histogram(e.to(tl.int32), BE)
    b = tl.arange(0, BE)
    tl.store(counts_ptr + b, counts.to(tl.int64), mask=b < E)


@triton.jit
def _block_counts(idx_ptr, part_ptr, M, E, BLK: tl.constexpr, BE: tl.constexpr):
    blk = tl.program_id(0)
    i = blk * BLK + tl.arange(0, BLK)
    ok = i < M
    e = tl.where(ok, tl.load(idx_ptr + i, mask=ok, other=0), E)  # padding lanes count in the unused bin
    b = tl.arange(0, BE)
    tl.store(part_ptr + blk * BE + b, tl.histogram(e.to(tl.int32), BE))


@triton.jit
def _block_place(
    idx_ptr, part_ptr, base_ptr, token_ptr, pos_ptr, counts_ptr, M, K, E, NB, BLK: tl.constexpr, BE: tl.constexpr
):
    blk = tl.program_id(0)
    b = tl.arange(0, BE)
    counts = tl.zeros([BE], tl.int32)
    before = tl.zeros([BE], tl.int32)  # pairs of each expert in the blocks before this one
    for nb in range(NB):
        h = tl.load(part_ptr + nb * BE + b)
        counts += h
        before += tl.where(nb < blk, h, 0)
    # the sorted rows of expert x start at the pairs of smaller experts; this block's at `before` past that
    tl.store(base_ptr + blk * BE + b, tl.cumsum(counts, axis=0) - counts + before)
    if blk == 0:
        tl.store(counts_ptr + b, counts.to(tl.int64), mask=b < E)
    tl.debug_barrier()  # every thread's base entries are written before any thread reads one back
    j = tl.arange(0, BLK)
    i = blk * BLK + j
    ok = i < M
    e = tl.where(ok, tl.load(idx_ptr + i, mask=ok, other=0), E)
    # rank among this block's earlier pairs of the same expert: the stable order
    rank = tl.sum(((e[:, None] == e[None, :]) & (j[None, :] < j[:, None])).to(tl.int32), axis=1)
    p = (tl.load(base_ptr + blk * BE + e, mask=ok, other=0) + rank).to(tl.int64)
    tl.store(pos_ptr + i, p, mask=ok)
    tl.store(token_ptr + p, (i // K).to(tl.int64), mask=ok)


@triton.jit
def _combine(ys_ptr, w_ptr, pos_ptr, out_ptr, D, sy, K: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j)
        y = tl.load(ys_ptr + p * sy + d, mask=ok, other=0.0).to(tl.float32)
        acc += round_to(w * y, out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * D + d, round_to(acc, out_ptr.dtype.element_ty), mask=ok)


def supports(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_experts: int) -> bool:
    """Whether the kernels take this forward (module docstring); else the definition runs."""
    return (
        x.dim() == 2
        and x.dtype in DTYPES
        and indices.dim() == 2
        and indices.dtype == torch.int64
        and indices.is_contiguous()
        and 0 < indices.numel() <= MAX_PAIRS
        and num_experts <= MAX_EXPERTS
        and weights.shape == indices.shape
        and weights.dtype == torch.float32
        and weights.is_contiguous()
        and indices.device == x.device == weights.device
    )


def align(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indices [N, k] -> (token_of [N * k], counts [num_experts], pos [N * k]), int64 (module docstring).

    Up to SORT_PAIRS pairs one program sorts them (one launch); more are placed by blocks of ALIGN_BLOCK
    pairs: per-block expert counts, then each pair's sorted row from the counts before it (two launches,
    a program per block: a one-program sort of a batch-256 step's 1,024 pairs took 17 us on the H200)."""
    m, k = indices.numel(), indices.shape[1]
    dev = indices.device
    token_of = torch.empty(m, dtype=torch.int64, device=dev)
    pos = torch.empty(m, dtype=torch.int64, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int64, device=dev)
    be = triton.next_power_of_2(num_experts + 1)
    if m <= SORT_PAIRS:
        _align[(1,)](
            indices, token_of, pos, counts, m, k, num_experts, BM=triton.next_power_of_2(m), BE=be, num_warps=4
        )
        return token_of, counts, pos
    nb = triton.cdiv(m, ALIGN_BLOCK)
    part = torch.empty(nb, be, dtype=torch.int32, device=dev)
    base = torch.empty(nb, be, dtype=torch.int32, device=dev)
    _block_counts[(nb,)](indices, part, m, num_experts, BLK=ALIGN_BLOCK, BE=be, num_warps=4)
    _block_place[(nb,)](
        indices, part, base, token_of, pos, counts, m, k, num_experts, nb, BLK=ALIGN_BLOCK, BE=be, num_warps=4
    )
    return token_of, counts, pos


def combine(ys: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sorted expert outputs ys [N * k, D] -> out [N, D] in `dtype` (module docstring)."""
    n, k = weights.shape
    d = ys.shape[1]
    assert ys.shape[0] == n * k and ys.stride(1) == 1 and ys.dtype in DTYPES and dtype in DTYPES
    out = torch.empty(n, d, dtype=dtype, device=ys.device)
    bd = min(triton.next_power_of_2(d), 1024)
    _combine[(n, triton.cdiv(d, bd))](
        ys, weights, pos, out, d, ys.stride(0), K=k, BD=bd, num_warps=4 if bd >= 512 else 2
    )
    return out
