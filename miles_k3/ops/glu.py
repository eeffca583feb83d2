"""Gated linear unit activations: SiLU-GLU and K3's SiTU-GLU.

SiTU-GLU (published formula, computed in fp32, or fp64 for fp64 inputs):
    out = [beta * tanh(gate / beta) * sigmoid(gate)] * [beta_lin * tanh(up / beta_lin)]
a SiLU whose linear factor is soft-capped at +-beta, times an up branch
soft-capped at +-beta_lin (K3: beta 4, beta_lin 25). It runs its Triton kernel (`miles_k3.kernels.situ_glu`:
one launch instead of eleven) where `miles_k3.kernels.use_kernels` says so and the kernel takes the call;
the code below is the definition the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_k3.kernels import use_kernels


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in the inputs' dtype (matches transformers' MLP)."""
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """SiTU-GLU in fp32 (fp64 for fp64); returns gate's dtype. gate, up [..., I]."""
    if use_kernels(gate):
        from miles_k3.kernels import situ_glu as kernels  # imported here: CPU installs never load triton

        if kernels.supports(gate, up):
            return kernels.situ_glu(gate, up, beta, beta_lin)
    dtype = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(dtype), up.to(dtype)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (act * (beta_lin * torch.tanh(u / beta_lin))).to(gate.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """Dispatch on the config's hidden_act ("silu" | "situ")."""
    if act == "silu":
        return silu_glu(gate, up)
    if act == "situ":
        return situ_glu(gate, up, beta, beta_lin)
    raise ValueError(f"unknown GLU activation {act!r}; expected 'silu' or 'situ'")
