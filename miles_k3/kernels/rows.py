"""Row layouts for the row kernels (norms, AttnRes, SiTU-GLU): tensors [..., D] whose last dim is contiguous
and whose leading dims are any strided view (columns of a wider GEMM output, heads of such a slice).

A kernel addresses row r of a tensor as (r // inner) * outer_stride + (r % inner) * inner_stride: two
leading dims, after merging each adjacent pair that every operand steps over as one (as TensorIterator
does). That covers [B, T] over a GEMM's column slice (B and T merge) and [B, T, H] over one (T and H do not),
so the engine's calls take no copy; a layout that stays three-dimensional is left to the definition.
"""

from __future__ import annotations

import torch


def row_layout(*tensors: torch.Tensor) -> tuple[int, list[tuple[int, int]]] | None:
    """For tensors of one shape [..., D], each with a unit last stride: (inner, [(outer_stride, inner_stride)
    per tensor]) addressing row r = (r // inner, r % inner) as above; None where the leading dims do not merge
    into two for all of them."""
    shape = tensors[0].shape[:-1]
    strides = [t.stride()[:-1] for t in tensors]
    dims: list[tuple[int, list[int]]] = []  # (size, stride per tensor), outermost first
    for i, n in enumerate(shape):
        if n == 1:  # a size-1 dim is never stepped over: its stride is meaningless
            continue
        step = [s[i] for s in strides]
        if dims and all(prev == n * s for prev, s in zip(dims[-1][1], step)):
            dims[-1] = (dims[-1][0] * n, step)  # the outer dim steps over this one whole: one dim
        else:
            dims.append((n, step))
    if len(dims) > 2:
        return None
    while len(dims) < 2:
        dims.insert(0, (1, [0] * len(tensors)))
    (_, outer), (inner, inner_step) = dims
    return inner, list(zip(outer, inner_step))
