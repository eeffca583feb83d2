"""Megatron parallel state for the trainer: set up / tear down, and the TP hooks the K3 layers call.

Ownership: `init_parallel` initializes megatron's `parallel_state` on a torch.distributed world that
the caller owns (`torch.distributed.init_process_group`, gloo on CPU, nccl on GPU); `destroy_parallel`
undoes only that. `single_process()` is the laptop path: when no world exists it starts a world of one
(gloo, free localhost port), initializes TP=1, and tears down on exit exactly what it created.

`init_parallel` forms every group (TP, PP, CP, EP inside DP x CP, DP) as megatron does; the model side
reads its shares from `MegatronTP` and its PP / CP / EP counterparts, never from globals.

CPU note: megatron's `gather_from_tensor_model_parallel_region` allocates its buffer with
`torch.cuda.current_device()`, so gathers here use `torch.distributed.all_gather` into per-rank lists
instead (`gather_last_dim`, `all_gather_dim`, the sequence gathers). `copy_to_...` / `reduce_from_...`
are plain all-reduces and are used as megatron ships them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from miles_k3.model.linear import TensorParallel
from miles_k3.ranks import end_world, free_port  # noqa: F401  (re-exported for the launchers and tests)


def init_parallel(
    tp_size: int = 1, pp_size: int = 1, cp_size: int = 1, ep_size: int = 1, *, gloo_groups: bool = True
) -> None:
    """Initialize megatron's model-parallel groups on the current torch.distributed world (which must exist).

    Sizes as megatron takes them: world = tp * pp * cp * dp, and expert parallelism is formed inside
    dp * cp (ep must divide it). Called again with the same sizes it does nothing; with other sizes it is
    an error (tear down first). `gloo_groups`: megatron's extra gloo groups (its CPU-side collectives); off
    for a world that cannot create them (the layout planner's fake world)."""
    if not dist.is_initialized():
        raise ValueError(
            "init_parallel needs torch.distributed initialized first "
            "(init_process_group), or use megatron_patches.parallel.single_process()"
        )
    world = dist.get_world_size()
    sizes = {
        "tensor-parallel": tp_size,
        "pipeline-parallel": pp_size,
        "context-parallel": cp_size,
        "expert-parallel": ep_size,
    }
    for what, n in sizes.items():
        if n < 1:
            raise ValueError(f"{what} size must be >= 1, got {n}")
    model = tp_size * pp_size * cp_size
    if world % model:
        raise ValueError(f"tp * pp * cp = {model} must divide the world size {world}")
    dp_cp = world // model * cp_size
    if dp_cp % ep_size:
        raise ValueError(f"expert-parallel size {ep_size} must divide dp * cp = {dp_cp} (world {world})")
    if ps.model_parallel_is_initialized():
        found = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if found != (tp_size, pp_size, cp_size, ep_size):
            raise ValueError(
                f"megatron parallel state is already initialized with (tp, pp, cp, ep) = {found}, "
                f"not {(tp_size, pp_size, cp_size, ep_size)}"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=cp_size,
        expert_model_parallel_size=ep_size,
        create_gloo_process_groups=gloo_groups,
    )


def destroy_parallel() -> None:
    """Tear down megatron's groups (not the torch.distributed world, which the caller owns)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def start_single_process_world() -> None:
    """A torch.distributed world of one process (gloo, localhost, a free port). No-op if one exists."""
    if dist.is_initialized():
        return
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """TP=1 in this process without the caller touching torch.distributed. Creates (and on exit destroys)
    only what did not exist: the world of one, megatron's parallel state."""
    own_world = not dist.is_initialized()
    start_single_process_world()
    own_state = not ps.model_parallel_is_initialized()
    if own_state:
        init_parallel(1)
    try:
        yield
    finally:
        if own_state:
            destroy_parallel()
        if own_world:
            dist.destroy_process_group()


def ensure_parallel() -> None:
    """Make sure megatron's parallel state exists; with no torch.distributed world at all, start a world of
    one and TP=1 (left running for the process: `destroy_parallel` + `destroy_process_group` end it)."""
    if ps.model_parallel_is_initialized():
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "torch.distributed is running with several ranks but megatron's parallel state is "
            "not: call megatron_patches.parallel.init_parallel(tp_size) first"
        )
    start_single_process_world()
    init_parallel(1)


class _GatherDim(torch.autograd.Function):
    """All-gather along `dim` (forward), keep this rank's slice of the gradient (backward: the consumers are
    tensor-parallel blocks or the vocab-split lm_head, which leave the same full gradient on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


class _ScatterDim(torch.autograd.Function):
    """Keep this rank's slice along `dim` of a tensor that is the same on every rank (forward); all-gather
    the slices' gradients (backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


class MegatronTP(TensorParallel):
    """The TP share of this rank in megatron's tensor-model-parallel group, with its collectives.

    `sequence_parallel`: the residual stream holds this rank's slice of the sequence (see
    `miles_k3.model.linear`). megatron-core 0.16.1's own sequence-parallel mappings allocate their
    buffers on CUDA and split dim 0 of its [S, B, H] layout, so the gathers here are device-agnostic
    all-gathers along dim 1 of our [B, T, D]."""

    def __init__(self, sequence_parallel: bool = False):
        if not ps.model_parallel_is_initialized():
            raise ValueError("megatron's parallel state is not initialized: call init_parallel(tp_size)")
        super().__init__(
            ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), sequence_parallel
        )
        self.group = ps.get_tensor_model_parallel_group()

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else copy_to_tensor_model_parallel_region(x, group=self.group)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (forward all-reduce, backward identity)."""
        return x if self.size == 1 else reduce_from_tensor_model_parallel_region(x, group=self.group)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' slices along the last dim, differentiably."""
        return x if self.size == 1 else _GatherDim.apply(x, -1, self.group)

    def seq_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return _ScatterDim.apply(x, 1, self.group) if self.sequence_parallel else x

    def seq_gather(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherDim.apply(x, 1, self.group) if self.sequence_parallel else x

    def all_gather_dim(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate the ranks' slices along `dim` (no autograd; for exporting adapter tensors)."""
        return all_gather_cat(x, dim, self.group, self.size)


def all_gather_cat(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """The `size` ranks' tensors of `group` concatenated along `dim` in rank order (no autograd)."""
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
