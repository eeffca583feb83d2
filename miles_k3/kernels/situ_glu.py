"""SiTU-GLU in one kernel: out = [beta tanh(g / beta) sigmoid(g)] * [beta_lin tanh(u / beta_lin)].

The torch definition (`miles_k3.ops.glu.situ_glu`) upcasts gate and up, runs eight elementwise ops in fp32
and casts back: eleven kernels per call on CUDA. This reads gate and up once, computes in fp32 registers and
writes the result in gate's dtype, one kernel.

Contract of `situ_glu(gate, up, beta, beta_lin)` (`supports` says which calls qualify; `miles_k3.ops.glu`
sends the others to the definition):
- gate, up [..., I] of one shape and one dtype (fp32 / bf16 / fp16), on one device; each row contiguous, the
  leading dims any strides that merge into two for both (`rows.row_layout`: columns of a wider GEMM output).
- returns a new contiguous [..., I] in gate's dtype. fp32 math as the definition's, so results match the
  definition to fp32 rounding, and in bf16 to one unit in the last place. tanh (Triton has no portable one,
  and the interpreter runs no libdevice): its odd Taylor series to x^7 below |x| = 1/16, where
  (1 - e^-2|x|) / (1 + e^-2|x|) would lose its relative digits, that quotient above. (The first version's
  1 - 2 / (e^2x + 1) lost them near 0: on one H200, 2026-12-02, it missed the fp32 bound for |u| << beta_lin.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_k3.kernels.rounding import DTYPES, round_to
from miles_k3.kernels.rows import row_layout


@triton.jit
def _tanh(x):
    a = tl.abs(x)
    t = tl.exp(-2.0 * a)  # underflows to 0 for large |x|: the quotient saturates at 1
    far = (1.0 - t) / (1.0 + t)
    a2 = a * a
    near = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    y = tl.where(a < 0.0625, near, far)
    return tl.where(x < 0, -y, y)


@triton.jit
def _situ_glu(gate_ptr, up_ptr, out_ptr, inner, cols, gs0, gs1, us0, us1, beta, beta_lin, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    outer, within = row // inner, row % inner  # rows.row_layout
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    g = tl.load(gate_ptr + outer * gs0 + within * gs1 + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + outer * us0 + within * us1 + offs, mask=ok, other=0.0).to(tl.float32)
    act = beta * _tanh(g / beta) * tl.sigmoid(g)
    out = act * (beta_lin * _tanh(u / beta_lin))
    tl.store(out_ptr + row * cols + offs, round_to(out, out_ptr.dtype.element_ty), mask=ok)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel takes this call (module docstring); else the definition runs."""
    return (
        gate.dim() > 0
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in DTYPES
        and gate.device == up.device
        and gate.stride(-1) == 1
        and up.stride(-1) == 1
        and row_layout(gate, up) is not None
    )


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """gate, up [..., I] -> SiTU-GLU [..., I] in gate's dtype (module docstring)."""
    assert supports(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    cols = gate.shape[-1]
    if out.numel() == 0:
        return out
    inner, ((gs0, gs1), (us0, us1)) = row_layout(gate, up)
    block = min(1024, triton.next_power_of_2(cols))
    _situ_glu[(out.numel() // cols, triton.cdiv(cols, block))](
        gate, up, out, inner, cols, gs0, gs1, us0, us1, float(beta), float(beta_lin), BLOCK=block
    )
    return out
