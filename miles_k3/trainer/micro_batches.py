"""How one minibatch is spread over the trainer's ranks and micro-batches, and how their metrics come back.

A minibatch (whole GRPO groups) is split over the data-parallel ranks by group (`data_share`), and each rank's
share into micro-batches of whole sequences under a token budget (`micro_batches`), which megatron's schedule
runs (1F1B over the pipeline stages). Every piece's loss is normalized by the whole minibatch's denominators,
so the gradients summed over micro-batches and ranks are the whole minibatch's, and so are the metrics that
`combine_metrics` returns on every rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from miles_k3.trainer.batch import Packed, TrainBatch, pack

# Metrics that are sums over the whole batch once each piece's loss is normalized by the batch's denominators;
# every other metric is a per-token mean, combined weighted by the pieces' token counts.
SUMMED = ("loss", "pg_loss", "kl_loss")
# Metrics that are maxima over tokens: the largest piece's value, over every rank holding real tokens.
MAXED = ("train_rollout_logprob_abs_diff_max",)


class Piece(NamedTuple):
    """One micro-batch: its sequences (`batch`), their packed form, its index in this rank's list, and the
    weight of its loss: 1, or 0 for a stand-in (`data_share`, `even_out`) that runs the step's collectives and
    adds nothing."""

    batch: TrainBatch
    packed: Packed
    index: int
    weight: float = 1.0

    @property
    def tokens(self) -> int:
        """Response tokens that carry loss (environment tokens of multi-turn samples are not counted), counted
        on the host from the batch's masks (no device sync); none for a stand-in."""
        return self.batch.policy_tokens() if self.weight else 0


def data_share(batch: TrainBatch, size: int | None = None, rank: int | None = None) -> tuple[TrainBatch, float]:
    """(this data-parallel rank's whole groups of `batch`, the weight of their loss): all of it without data
    parallelism. A minibatch can hold fewer groups than there are ranks (dynamic sampling keeps only groups
    that carry a signal); a rank left without one gets the first share as a stand-in of weight 0: it still
    runs the forward and backward, whose collectives (expert dispatch, gradient reductions) need every rank,
    and adds nothing to the loss, the gradients or the metrics. `size` / `rank`: megatron's data-parallel
    group by default."""
    if size is None or rank is None:
        from megatron.core import parallel_state as ps

        size, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if size == 1:
        return batch, 1.0
    shares = batch.split_by_groups(size)
    return (shares[rank], 1.0) if rank < len(shares) else (shares[0], 0.0)


def micro_batches(batch: TrainBatch, max_tokens: int | None, device: torch.device, weight: float = 1.0) -> list[Piece]:
    """`batch`'s sequences in order, cut into micro-batches of at most `max_tokens` packed tokens (prompt +
    response; a longer sequence is a micro-batch of its own); None: one micro-batch. `weight`: each piece's
    (`Piece.weight`)."""
    rows: list[list[int]] = [[]]
    used = 0
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
        n = len(p) + len(r)
        if max_tokens is not None and rows[-1] and used + n > max_tokens:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return [Piece(sub, pack(sub, device), k, weight) for k, sub in enumerate(batch.select(r) for r in rows)]


def even_out(pieces: list[Piece], device: torch.device) -> list[Piece]:
    """This rank's micro-batches, extended with stand-ins (its first sequence alone, weight 0) to as many as the
    data-parallel rank with the most has, under expert parallelism: a micro-batch's expert dispatch is a
    collective of the expert group, which spans data-parallel ranks whose shares (and token budgets) can cut
    into different counts; one rank's extra micro-batch then waited for a dispatch the others never ran (two
    gloo ranks of `parallel=ep2 parallel.micro_batch_tokens=64`: a hang; PP=2 x EP=2: a collective size
    mismatch). Without expert parallelism nothing spans data-parallel ranks per micro-batch: unchanged."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1 or ps.get_data_parallel_world_size() == 1:
        return pieces
    group = ps.get_data_parallel_group()
    most = for_group(torch.tensor([len(pieces)]), group)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    first = pieces[0].batch.select([0])
    return pieces + [Piece(first, pack(first, device), len(pieces) + k, 0.0) for k in range(int(most) - len(pieces))]


def for_group(t: torch.Tensor, group) -> torch.Tensor:
    """t where `group`'s backend takes it: nccl reduces device tensors only, gloo host ones."""
    import torch.distributed as dist

    return t.to(torch.device("cuda", torch.cuda.current_device())) if dist.get_backend(group) == "nccl" else t


def combine_metrics(
    per_piece: list[dict[str, torch.Tensor]], tokens: list[int], total_tokens: int
) -> dict[str, torch.Tensor]:
    """The metrics of this rank's micro-batches (`tokens[i]` loss-carrying response tokens each, of the minibatch's
    `total_tokens` over every data-parallel rank) -> the whole minibatch's, the same on every rank: loss terms
    summed, per-token means weighted by token counts (exact for token means; a sequence-level statistic such
    as rollout_ess becomes the token-weighted mean of the pieces' values), maxima (`MAXED`) the largest of the
    pieces that hold tokens."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    names = sorted(per_piece[0])
    maxed = torch.tensor([name in MAXED for name in names])
    flat = torch.zeros(len(names), dtype=torch.float64)
    peak = torch.full((len(names),), -torch.inf, dtype=torch.float64)
    for metrics, n in zip(per_piece, tokens):
        # one device-to-host copy a piece, not one a metric (each is a wait for the device)
        values = torch.stack([torch.as_tensor(metrics[name]).detach().reshape(()).double() for name in names]).cpu()
        flat += values * torch.tensor(
            [1.0 if name in SUMMED else n / total_tokens for name in names], dtype=torch.float64
        )
        if n:  # a stand-in holds no tokens of its own
            peak = torch.maximum(peak, values)
    if ps.get_data_parallel_world_size() > 1:
        group = ps.get_data_parallel_group()
        reduced = for_group(torch.stack([flat, peak]), group)  # nccl takes device tensors only: one copy each way
        dist.all_reduce(reduced[0], group=group)
        dist.all_reduce(reduced[1], op=dist.ReduceOp.MAX, group=group)
        flat, peak = reduced.cpu()
    return dict(zip(names, torch.where(maxed, peak, flat).float()))
