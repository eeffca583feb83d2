"""Expert parallelism for the trainer: the routed experts split over megatron's expert-model-parallel group
and the dropless all-to-all token dispatch between the ranks.

Layout. `ep` ranks each hold `num_experts / ep` contiguous experts: rank r the global experts
[r * E_local, (r + 1) * E_local). Megatron forms the EP group inside dp * cp (`init_parallel`), so the
ranks of one EP group hold different tokens (their own data / sequence shards) and the same dense
weights. Expert tensor parallelism is 1 under EP (megatron's `expert_tensor_parallel_size`): an expert
is whole on its rank, and EP > 1 with TP > 1 is refused (`expert_share`). Megatron would fold such an EP
group onto the TP ranks, which needs each TP rank to hold distinct tokens at the MoE; our sequence
parallelism gathers the sequence before the MLP, so every TP rank would send the same tokens twice.

Dispatch (forward of one MoE layer, after routing on the full width and the latent down-projection):
    1. each rank sorts its token copies by global expert (`RoutedExperts.forward`), so the copies for one
       owner are one contiguous run;
    2. the per-expert counts are exchanged (one all-to-all of E integers, then a host read of the splits);
    3. the copies go to their owners (all-to-all, uneven splits) and are re-sorted there from
       source-major to expert-major, so each local expert reads one contiguous block;
    4. after the experts, the inverse: back to source-major, all-to-all back, and the owner of the token
       adds the weighted outputs in global expert order, exactly as the single-process model does.
Every step is a gather / permutation, so EP computes what one process computes on the union of the
ranks' tokens (up to the GEMMs' blocking over different row counts).

Why not megatron's `MoEAlltoAllTokenDispatcher`: in megatron-core 0.16.1 it creates a `torch.cuda.Stream`
when it is built and moves its split sizes to the host on that side stream with CUDA events, wants a
`TransformerConfig` with megatron's MoE fields, and its permute / unpermute pair repeats the expert sort
that `RoutedExperts.forward` already does; its differentiable `all_to_all` allocates the uneven-split
output on `torch.cuda.current_device()`. A CPU run would need all of that redirected. What it does for us
is one uneven all-to-all each way, which gloo supports (`all_to_all_single` with split lists); so the
all-to-all here is torch.distributed's own, in an autograd Function that allocates on the input's device.

Collectives in backward (gloo hangs if ranks issue them in different orders, or if one rank records a
backward another does not): the only ones under EP are the two all-to-alls per MoE layer; each layer's
combine backward needs the gradients of every later layer, so all ranks run them in the same order. Every
rank records both whenever grad mode is on, even when its own input needs no gradient or it receives no
rows (see `ExpertParallel.dispatch`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_patches.parallel import all_gather_cat


class _AllToAll(torch.autograd.Function):
    """Rows of `x` in runs of `send` (one run per rank of the group) -> the runs every rank sent here, in
    rank order (`recv` rows from each). Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return out, None, None, None


class DispatchPlan(NamedTuple):
    """What `combine` needs to undo one `dispatch`."""

    send: list[int]  # rows this rank sent to each rank
    recv: list[int]  # rows this rank received from each rank
    order: torch.Tensor  # received (source-major) row of each expert-major row
    inverse: torch.Tensor  # expert-major row of each received row


class ExpertParallel:
    """This rank's share of the routed experts: `size` ranks in megatron's expert-model-parallel group,
    this one `rank`. Size 1 (`NO_EP`) holds every expert and its dispatch is the identity.

    The same duck type as `TensorParallel` for what adapters need of a split (`size`, `rank`, `shard`,
    `all_gather_dim`, `group`), so an expert adapter split over EP is exported and clipped like a
    tensor-parallel one."""

    def __init__(self, size: int = 1, rank: int = 0, group=None):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"ExpertParallel: need size >= 1 and 0 <= rank < size, got size={size}, rank={rank}")
        self.size, self.rank, self.group = size, rank, group

    def split(self, num_experts: int) -> int:
        """Experts per rank; a ValueError names the config field when they do not divide."""
        if num_experts % self.size:
            raise ValueError(
                f"K3Config.num_experts={num_experts} is not divisible by the expert-parallel size {self.size}"
            )
        return num_experts // self.size

    def local_experts(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds."""
        n = self.split(num_experts)
        return range(self.rank * n, (self.rank + 1) * n)

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of `full` along `dim` (the expert dim of stacked tensors)."""
        if self.size == 1:
            return full
        step = self.split(full.shape[dim])
        return full.narrow(dim, self.rank * step, step)

    def all_gather_dim(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate the ranks' slices along `dim` in rank order (no autograd; for export)."""
        return all_gather_cat(x, dim, self.group, self.size)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, xs: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
        """xs [M, W]: this rank's token copies sorted by global expert, counts [E] of them per expert ->
        (rows [M', W] for this rank's experts sorted by local expert, their counts [E_local], the plan).

        Under grad mode the exchange is always recorded for backward: an input that needs no gradient is
        made a leaf that does (its gradient is dropped), so every rank runs the same backward all-to-alls."""
        e_local = self.split(counts.numel())
        # recv_counts[s, e]: copies rank s sends for local expert e
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        recv_counts = recv_counts.view(self.size, e_local)
        send = counts.view(self.size, e_local).sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        if torch.is_grad_enabled() and not xs.requires_grad:
            xs = xs.detach().requires_grad_()
        received = _AllToAll.apply(xs, send, recv, self.group)
        # received rows are source-major ([s][e] runs); the experts want expert-major ([e][s] runs)
        expert_of_row = torch.repeat_interleave(
            torch.arange(e_local, device=counts.device).repeat(self.size), recv_counts.reshape(-1)
        )
        order = expert_of_row.argsort(stable=True)
        plan = DispatchPlan(send, recv, order, order.argsort())
        return received[order], recv_counts.sum(0), plan

    def combine(self, ys: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The local experts' outputs [M', W] (expert-major, as `dispatch` returned the rows) -> the outputs
        of this rank's own copies [M, W], in the order it dispatched them."""
        return _AllToAll.apply(ys[plan.inverse], plan.recv, plan.send, self.group)


NO_EP = ExpertParallel()


def expert_share(tp_size: int) -> ExpertParallel:
    """This rank's EP share from megatron's parallel state (`NO_EP` when EP is 1).

    Refuses what the experts do not build: EP > 1 with tensor parallelism (expert TP stays 1), and a
    megatron state whose expert-tensor-parallel size differs from the split the experts use (TP at EP=1,
    1 under EP)."""
    size = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    if size > 1 and tp_size > 1:
        raise ValueError(
            f"parallel.ep={size} with parallel.tp={tp_size}: expert parallelism runs with "
            "expert tensor parallelism 1; use tp=1 with ep > 1"
        )
    want = 1 if size > 1 else tp_size
    if etp != want:
        raise ValueError(
            f"megatron's expert_tensor_parallel_size is {etp}; the routed experts split their "
            f"intermediate dim over {want} rank(s) (tp at ep=1, 1 under ep)"
        )
    if size == 1:
        return NO_EP
    return ExpertParallel(size, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group())
