"""The KDA forget gate in one kernel, and optionally the delta-rule write strength beta in the same launch.

The torch definition (`miles_k3.ops.kda.kda_gate`) upcasts f, dt_bias and A_log, adds, exponentiates, and
applies the form's nonlinearity and scale: about eight kernels per call on CUDA, once per KDA layer per
step. This reads f once and writes the fp32 gate, one kernel; beta = sigmoid(b) (two more kernels in the
mixer) can ride along.

Contract of `kda_gate(f, A_log, dt_bias, num_heads=H, softplus=..., lower_bound=..., b=None)` (`supports`
says which calls qualify; `miles_k3.ops.kda` sends the others to the definition):
- f [..., H*K] and b [..., H] (same leading dims) or None, each fp32 / bf16 / fp16, any strides (a copy is
  taken only where the leading dims do not flatten to one); A_log with >= H elements, of which the first H
  (flattened) are the heads' log rates; dt_bias with H*K elements or None; these two of any float dtype.
- returns (g [..., H, K] fp32 contiguous, beta [..., H] fp32 contiguous or None):
  softplus form (Kimi-Linear): g = -exp(A_log[h]) * softplus(f + dt_bias), softplus as torch's (the input
  past 20, else log1p(exp(x))); lower-bound form (K3): g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias));
  beta = sigmoid(b). The definition's operations in its order, in fp32.
- against the definition: both compute in fp32 from the same upcast values and return fp32, for every input
  dtype, so they differ only by their exp / log (numpy's under the interpreter, Triton's exp2-based one on the
  GPU, torch's own): a unit or two in the last place, amplified by exp's condition number |argument| where
  a sigmoid or softplus saturates, and so only where the gate is tiny: within 2e-6 relative or 1e-7 absolute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_k3.kernels.rounding import DTYPES


@triton.jit
def _log1p(u):
    # log(1 + u) keeping u's relative digits where 1 + u rounds (Goldberg's correction: the rounding of
    # 1 + u cancels in log(v) / (v - 1)); u itself where 1 + u == 1. Triton has no portable log1p.
    v = 1.0 + u
    return tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))


@triton.jit
def _kda_gate(
    f_ptr,
    a_ptr,
    bias_ptr,
    b_ptr,
    g_ptr,
    beta_ptr,
    HK,
    K,
    H,
    sf_row,
    sf_col,
    sb_row,
    sb_col,
    lower_bound,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    HAS_BETA: tl.constexpr,
    BLOCK: tl.constexpr,
    BH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < HK
    x = tl.load(f_ptr + row * sf_row + col * sf_col, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(a_ptr + col // K, mask=ok, other=0.0).to(tl.float32))
    if SOFTPLUS:
        sp = tl.where(x > 20.0, x, _log1p(tl.exp(x)))  # torch's threshold: beyond it softplus(x) is x in fp32
        g = -rate * sp
    else:
        g = lower_bound * tl.sigmoid(rate * x)
    tl.store(g_ptr + row * HK + col, g, mask=ok)
    if HAS_BETA:
        if tl.program_id(1) == 0:  # one program per row writes its H betas
            h = tl.arange(0, BH)
            h_ok = h < H
            bv = tl.load(b_ptr + row * sb_row + h * sb_col, mask=h_ok, other=0.0).to(tl.float32)
            tl.store(beta_ptr + row * H + h, tl.sigmoid(bv), mask=h_ok)


def supports(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, b: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes this call of `miles_k3.ops.kda.kda_gate` / `kda_gate_beta` (shapes already
    checked there); else the definition runs. Not fp64 math (fp64 f or b), not K = 0, one device."""
    params = [t for t in (A_log, dt_bias) if t is not None]  # upcast to fp32 by both sides, whatever they are
    return (
        f.dtype in DTYPES
        and f.shape[-1] > 0
        and (b is None or (b.dtype in DTYPES and b.device == f.device))
        and all(t.dtype.is_floating_point and t.device == f.device for t in params)
    )


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    *,
    num_heads: int,
    softplus: bool,
    lower_bound: float,
    b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """f [..., H*K] -> (g [..., H, K] fp32, beta = sigmoid(b) [..., H] fp32 or None) in one launch (module
    docstring). Shapes are the caller's to check (`miles_k3.ops.kda` does)."""
    assert f.dtype in DTYPES, f.dtype
    H = num_heads
    HK = f.shape[-1]
    K = HK // H
    lead = f.shape[:-1]
    rows = f.reshape(-1, HK)  # a view for the usual layouts; a copy only for odd strides
    g = torch.empty(*lead, H, K, dtype=torch.float32, device=f.device)
    beta = None
    b_rows = rows  # any pointer: never read without b
    if b is not None:
        assert b.shape == (*lead, H), (b.shape, lead, H)
        b_rows = b.reshape(-1, H)
        beta = torch.empty(*lead, H, dtype=torch.float32, device=f.device)
    if rows.shape[0] == 0:
        return g, beta
    a = A_log.reshape(-1)[:H].contiguous()  # no copy for a parameter; the kernel reads it with stride 1
    bias = dt_bias.reshape(-1).contiguous() if dt_bias is not None else rows
    block = min(1024, triton.next_power_of_2(HK))
    grid = (rows.shape[0], triton.cdiv(HK, block))
    _kda_gate[grid](
        rows,
        a,
        bias,
        b_rows,
        g,
        beta if beta is not None else g,
        HK,
        K,
        H,
        *rows.stride(),
        *b_rows.stride(),
        float(lower_bound),
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=softplus,
        HAS_BETA=b is not None,
        BLOCK=block,
        BH=triton.next_power_of_2(H),
    )
    return g, beta
