"""The seam between the K3 math and whoever owns the weights.

Layers never construct `nn.Linear` themselves: they ask a `LinearFactory` for
each projection, passing a `LinearSpec` (HF module name, shape, and how a
tensor-parallel build would split it). The reference model uses plain
`nn.Linear`; `megatron_patches` returns megatron's parallel linears with LoRA,
and `rollout` returns MXFP4 + LoRA linears. Routed experts are one pluggable
block (`ExpertsFactory`), because trainers and engines group them differently.

Contract of a linear module: `forward(x [..., in]) -> [..., out]`, no bias, and
its base weight loads from / saves to `<name>.weight` of shape [out, in].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import nn

Parallel = Literal["column", "row", "replicated"]


class LinearSpec(NamedTuple):
    name: str  # HF module path without wrapper prefix, e.g. "model.layers.3.self_attn.q_proj"
    in_features: int
    out_features: int
    parallel: Parallel  # column: split out_features; row: split in_features; replicated: whole everywhere


class ExpertsSpec(NamedTuple):
    name: str  # e.g. "model.layers.3.block_sparse_moe.experts"
    num_experts: int
    width: int  # the width experts read and write (latent width for LatentMoE)
    intermediate: int
    act: str  # "silu" | "situ"
    situ_beta: float
    situ_beta_lin: float


LinearFactory = Callable[[LinearSpec], nn.Module]
ExpertsFactory = Callable[[ExpertsSpec], nn.Module]


def torch_linear(spec: LinearSpec) -> nn.Module:
    return nn.Linear(spec.in_features, spec.out_features, bias=False)


def torch_experts(spec: ExpertsSpec) -> nn.Module:
    from miles_k3.model.moe import RoutedExperts

    return RoutedExperts(spec)
