"""Norm modules holding `weight`, calling the ops in `miles_k3.ops.norm`."""

from __future__ import annotations

import torch
from torch import nn

from miles_k3.ops.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
