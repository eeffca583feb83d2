"""Rounding fp32 to a kernel's output dtype, to nearest-even as torch's `.to(dtype)` does.

CUDA's conversions round to nearest-even, but Triton's interpreter converts fp32 to bf16 by truncation (its
`cast_impl`), which puts about half of all bf16 results one ulp off torch's and would leave the CPU tests of
a kernel unable to tell its math from that artefact. So bf16 is rounded here in integer arithmetic, which
runs the same everywhere (a few integer ops in a kernel bound by its launch and memory); fp16 and fp32 use
the plain conversion, which rounds to nearest-even on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The input and output dtypes every kernel of miles_k3.kernels takes (fp32 math inside): the ones `round_to`
# rounds to; fp64 always runs the definition (the exactness tests compare its math).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x -> dtype (bf16 / fp16 / fp32), rounded to nearest-even; NaN stays NaN, overflow gives inf."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # add just under half a bf16 ulp, plus one when the kept lsb is odd (ties to even), then keep the top 16
        # bits: the carry runs into the exponent where the mantissa overflows, so the largest values give inf
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        y = tl.where(x != x, x.to(tl.bfloat16), y)  # a NaN's carry could reach the sign or make it inf
    else:
        y = x.to(dtype)
    return y
