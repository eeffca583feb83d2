"""The seam between the K3 math and whoever owns the weights.

Layers never construct `nn.Linear` themselves: they ask a `LinearFactory` for
each projection, passing a `LinearSpec` (HF module name, shape, and how a
tensor-parallel build would split it). The reference model uses plain
`nn.Linear`; `megatron_patches` returns megatron's parallel linears with LoRA,
and `rollout` returns MXFP4 + LoRA linears. Routed experts are one pluggable
block (`ExpertsFactory`), because trainers and engines group them differently.

Contract of a linear module: `forward(x [..., in]) -> [..., out]`, no bias, and
its base weight loads from / saves to `<name>.weight` of shape [out, in].

Tensor parallelism: a build that splits linears across ranks also passes a
`TensorParallel` (this rank's index and the group size) into the model, so the
mixers size their per-head tensors (heads, short-conv channels, decay rates)
for the local heads that a column split leaves them. Its linears then return
the local slice for "column" specs and take the local slice (and reduce) for
"row" specs. `SINGLE` (size 1) is the whole model: the reference and engine
builds use it and see no change.

Sequence parallelism (a tensor-parallel build with `sequence_parallel`): the residual stream between the
mixers and MLPs (embedding output, norms, AttnRes block bank and mixing, the final norm) holds only this
rank's contiguous slice of the sequence. The decoder layer gathers the sequence before each mixer / MLP
(`seq_gather`) and keeps its slice of their output (`seq_scatter`); inside them the tensor-parallel math
is unchanged.
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


class TensorParallel:
    """This rank's share of a tensor-parallel build: `size` ranks, this one `rank`.

    The base class is the single-device case and every method is the identity there. A parallel
    build (megatron_patches) subclasses it with real collectives. Only what the shared layers need
    lives here; the linears own their own communication.
    """

    def __init__(self, size: int = 1, rank: int = 0, sequence_parallel: bool = False):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"TensorParallel: need size >= 1 and 0 <= rank < size, got size={size}, rank={rank}")
        if sequence_parallel and size == 1:
            raise ValueError(
                "sequence parallelism needs tensor parallelism (size > 1): with one rank it shards nothing"
            )
        self.size, self.rank = size, rank
        self.sequence_parallel = sequence_parallel

    def split(self, n: int, field: str) -> int:
        """The local share of n heads / channels; `field` names the config field for the error."""
        if n % self.size:
            raise ValueError(f"K3Config.{field}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Mark a replicated tensor that per-rank (local-head) math reads without a column linear in
        between (MLA's shared rope key). Forward: identity. Backward in a parallel build: all-reduce, since
        each rank's gradient covers only its own heads."""
        return x

    def seq_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallel: [B, T, D], the same on every rank -> this rank's [B, T / size, D] slice
        (backward: all-gather of the slices' gradients). Identity without sequence parallelism."""
        return x

    def seq_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallel: this rank's [B, T / size, D] -> the whole [B, T, D] (backward: this rank's
        slice of the gradient, which tensor-parallel blocks leave the same on every rank). Identity
        without sequence parallelism."""
        return x

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of `full` along `dim` (loading full tensors; `full` itself at size 1)."""
        if self.size == 1:
            return full
        n = full.shape[dim]
        assert n % self.size == 0, f"dim {dim} of size {n} does not split over {self.size} ranks"
        step = n // self.size
        return full.narrow(dim, self.rank * step, step)


SINGLE = TensorParallel()
