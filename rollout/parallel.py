"""The engine sharded over a torch.distributed group: this rank's shares (TP, EP, DCP), their collectives, the
leader / follower protocol that keeps one scheduler decision per step (`rollout.build.build_sharded_engine`
builds a rank).

Layout, as the seed deploys K3 (`EngineTP`): attention is tensor-parallel over the whole group (KDA and MLA
heads split, row-parallel output projections all-reduced); the routed experts are either split by their
intermediate dim (EP = 1: w1 / w3 column, w2 row, one all-reduce) or held whole, num_experts / ep per rank,
with EP over the same ranks as TP (`ep_size` = tp size); MLA's latent KV is sharded by token position over
DCP groups of `dcp_size` consecutive TP ranks (`rollout.dcp`).

The lm_head is vocab-parallel, its logits all-gathered before sampling: the sampler needs the whole
distribution (the reported log-prob is the untruncated one), and the gather reassembles exactly the logits
one device computes, column for column, so log-probs equal TP=1's, while each rank holds and multiplies
only vocab / tp rows of the largest matrix of a decode step. The embedding (a lookup) is replicated. With
tied embeddings the logits come from the replicated embedding, whole, with no gather.

Why EP combines with an all-reduce here, not an all-to-all: every TP rank holds the same tokens at the MoE
(attention is tensor-parallel, not data-parallel), so each rank already has every token copy routed to its
own experts. It runs them (dropless: every copy, no capacity) and one all-reduce of the [tokens, width]
output sums the ranks' experts. An all-to-all dispatch would move top-k copies of tokens the receiver
already holds, and its uneven splits need a host read of the counts per MoE layer, which CUDA graphs and
the overlap schedule cannot have. (The trainer's EP is an all-to-all because its EP ranks hold different
tokens: `megatron_patches.expert_parallel`.)

One decision per step (`miles_k3.rpc`): every rank runs the same engine (scheduler, cache manager, radix
trees, pools) as a replicated state machine. Rank 0 is the caller's: its `submit` / `abort` / adapter / memory
calls are applied at once as calls of the engine's `REPLAYED` methods and logged, and each `step()` first
broadcasts the log (control plane: a gloo group, so it never waits on the device stream; tensors in the calls,
image features and adapters, over the TP group). The other ranks sit in `Engine.follow()`, replay the same
calls by name in the same order and step. Everything the scheduler reads is then the same on every rank: request
ids come with the submit, page / slot allocation and the trees' logical clocks are deterministic, the
logits are all-gathered (the same bytes everywhere), and every request samples from its own seed's noise
(an unseeded request gets a seed drawn by rank 0, sent with the submit), so the tokens agree without being
sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miles_k3.model.linear import TensorParallel
from miles_k3.rpc import Broadcast


class EngineTP(TensorParallel):
    """This rank's share of a sharded engine (inference only: no autograd, `enter` stays the identity).

    group: the TP group (default: the whole world); its rank 0 is the leader. `ep_size`: 1 (routed experts
    split by intermediate dim) or the TP size (whole experts, num_experts / ep per rank). `dcp_size`: ranks
    per DCP group (divides the TP size); DCP group g is TP ranks [g * dcp_size, (g + 1) * dcp_size) and this
    rank's DCP rank is its TP rank mod dcp_size. `control`: a gloo group over the same ranks for host-side
    broadcasts (default: `group` itself when it is gloo, else a new gloo group). Build it on every rank of
    the group at the same point (it creates process groups). Several engines in one world (one per group of
    ranks: the RL loop's replicas) build their groups first on every rank of the world, `replica_groups`, and
    pass them in (`control`, `dcp_group`): torch.distributed creates a group only with the whole world."""

    def __init__(self, group=None, *, ep_size: int = 1, dcp_size: int = 1, control=None, dcp_group=None):
        if not dist.is_initialized():
            raise ValueError("EngineTP needs torch.distributed initialized (init_process_group) on every rank")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        super().__init__(size, rank)
        self.group = group
        if ep_size not in (1, size):
            raise ValueError(
                f"ep_size={ep_size}: expert parallelism runs over the tensor-parallel ranks (ep_size 1 or {size})"
            )
        if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or dcp_size < 1 or size % dcp_size:
            raise ValueError(f"EngineConfig.dcp_size={dcp_size} must divide the tensor-parallel size {size}")
        self.ep_size, self.dcp_size = ep_size, dcp_size
        self.dcp_rank = rank % dcp_size
        self.channel_rank = dist.get_global_rank(group, 0) if group is not None else 0
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        self.dcp_group = dcp_group
        if dcp_size > 1 and dcp_group is None:  # every rank creates every group, in the same order
            for g in range(size // dcp_size):
                pg = dist.new_group(ranks[g * dcp_size : (g + 1) * dcp_size])
                if g == rank // dcp_size:
                    self.dcp_group = pg
        if control is None:
            control = group if dist.get_backend(group) == "gloo" else dist.new_group(ranks, backend="gloo")
        self.control = control

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group, in place (a row-parallel output)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' slices along the last dim concatenated in rank order (the vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (host side, over the gloo control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.channel_rank, group=self.control)
        return box[0]

    def transport(self, device: torch.device | str) -> Broadcast:
        """The leader / follower calls' transport (`miles_k3.rpc`): messages over the gloo control group,
        the tensors in them over the TP group, received on `device`."""
        return Broadcast(self.channel_rank, control=self.control, data=self.group, device=device)

    # ------------------------------------------------------------ shards of the checkpoint
    def column_block(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's block of n output rows."""
        step = n // self.size
        return self.rank * step, step

    def dcp_block(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's DCP group's block of n rows (its dcp_size TP ranks' heads)."""
        step = n // self.size * self.dcp_size
        return self.rank // self.dcp_size * step, step


def replica_groups(tp: int, dcp: int = 1, ep: int = 1) -> EngineTP:
    """This rank's `EngineTP` among world / tp engine replicas of `tp` consecutive ranks each (replica r: ranks
    [r * tp, (r + 1) * tp)), with `dcp` ranks per DCP group inside each. Call it on every rank of the world at
    the same point: it creates every replica's groups (TP, its gloo control group, its DCP groups) on every
    rank, in one order. `ep`: 1 or tp, as `EngineTP`'s `ep_size`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp or tp % dcp:
        raise ValueError(f"engine replicas of tp={tp} ranks (dcp={dcp}) do not tile a world of {world}")
    gloo = dist.get_backend() == "gloo"
    mine = None
    for r in range(world // tp):
        ranks = list(range(r * tp, (r + 1) * tp))
        group = dist.new_group(ranks)
        control = group if gloo else dist.new_group(ranks, backend="gloo")
        dcp_groups = [dist.new_group(ranks[g : g + dcp]) for g in range(0, tp, dcp)] if dcp > 1 else []
        if rank in ranks:
            mine = (group, control, dcp_groups[(rank - ranks[0]) // dcp] if dcp_groups else None)
    group, control, dcp_group = mine
    return EngineTP(group, ep_size=ep, dcp_size=dcp, control=control, dcp_group=dcp_group)
