"""A training batch of finished rollouts (a list of `Sample`s, the one record from the engine), and its packed
form for one varlen forward.

Sequence i is sample i's prompt_ids + output_ids. All sequences are packed into one row [1, N] with
`cu_seqlens`, so no padding is computed. Response token k of sequence i sits at packed position
p = start_i + len(prompt_i) + k and is predicted by the hidden state at p - 1; `positions` lists those
predicting positions, `targets` the tokens. Per-token results come back as [B, T] (T = the longest response)
with `mask` marking the tokens that carry loss, the layout `miles_k3.algo` takes.

Multi-turn samples (`rollout.fn`) carry a loss mask per response token: the policy's tokens (True) carry loss,
the environment's (tool output: False) are still part of the packed row, so the model reads them as context,
and their log-probs are computed alongside, but `mask()` leaves them out of the loss, TIS and every metric.

Image prompts carry their media per sample (`SequenceMedia`: the prompt positions of its media pads and the
images whose projected features replace their embeddings, the very features the engine was given); `pack`
places them in the packed row (`Packed.media`, a `MediaEmbeds` over packed positions: start_i + the pad's
prompt position), which the first pipeline stage splices in. The n samples of a prompt share one
`SequenceMedia` (pickled once when the batch travels to the trainer ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from miles_k3.data.sample import Sample, SequenceMedia

if TYPE_CHECKING:
    from miles_k3.model.modeling import MediaEmbeds


@dataclass
class TrainBatch:
    """The samples of one update, each with its advantage set; `group_index` names its group (the loop
    numbers the kept groups 0..K-1). The columns the trainer reads are views of the samples."""

    samples: list[Sample]

    def __post_init__(self) -> None:
        for i, s in enumerate(self.samples):
            n = len(s.output_ids)
            if not n or len(s.logprobs) != n or len(s.loss_mask) != n:
                raise ValueError(
                    f"sequence {i}: {n} response tokens, {len(s.logprobs)} log-probs, "
                    f"{len(s.loss_mask)} loss-mask entries (>= 1 token, one each per token)"
                )
            if not any(s.loss_mask):
                raise ValueError(f"sequence {i}: no policy token in its loss mask")
            m = s.media
            if m is not None and (
                tuple(m.features.shape[:1]) != (len(m.positions),)
                or not all(0 <= q < len(s.prompt_ids) for q in m.positions)
            ):
                raise ValueError(
                    f"sequence {i}: media {len(m.positions)} pads at {m.positions[:4]}..., features "
                    f"{tuple(m.features.shape)}, prompt of {len(s.prompt_ids)} tokens"
                )

    @classmethod
    def of(
        cls,
        prompts: list[list[int]],
        responses: list[list[int]],
        rollout_logprobs: list[list[float]],
        advantages: list[float],
        group_ids: list[int],
        loss_masks: list[list[bool]] | None = None,
        media: list[SequenceMedia | None] | None = None,
    ) -> TrainBatch:
        """A batch from columns (tests and benchmarks that have no rollout): one sample per row; no loss
        mask means every response token carries loss."""
        n = len(prompts)
        if {len(responses), len(rollout_logprobs), len(advantages), len(group_ids)} != {n}:
            raise ValueError(
                f"batch columns disagree in length: {n} prompts, {len(responses)} responses, "
                f"{len(rollout_logprobs)} log-prob lists, {len(advantages)} advantages, "
                f"{len(group_ids)} group ids"
            )
        masks = loss_masks if loss_masks is not None else [[True] * len(r) for r in responses]
        media = media if media is not None else [None] * n
        if len(masks) != n or len(media) != n:
            raise ValueError(f"{n} sequences, {len(masks)} loss masks, {len(media)} media entries")
        return cls(
            [
                Sample(
                    "",
                    "",
                    group_index=g,
                    prompt_ids=list(p),
                    output_ids=list(r),
                    logprobs=list(lp),
                    loss_mask=list(m),
                    media=md,
                    advantage=a,
                )
                for p, r, lp, a, g, m, md in zip(
                    prompts, responses, rollout_logprobs, advantages, group_ids, masks, media
                )
            ]
        )

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def prompts(self) -> list[list[int]]:
        return [s.prompt_ids for s in self.samples]

    @property
    def responses(self) -> list[list[int]]:
        return [s.output_ids for s in self.samples]

    @property
    def rollout_logprobs(self) -> list[list[float]]:
        """The engine's log-prob of each response token."""
        return [s.logprobs for s in self.samples]

    @property
    def advantages(self) -> list[float]:
        return [s.advantage for s in self.samples]

    @property
    def group_ids(self) -> list[int]:
        return [s.group_index for s in self.samples]

    @property
    def loss_masks(self) -> list[list[bool]]:
        return [s.loss_mask for s in self.samples]

    @property
    def media(self) -> list[SequenceMedia | None] | None:
        """Per sequence, its prompt's images (None for a text prompt); None: a text-only batch."""
        media = [s.media for s in self.samples]
        return media if any(m is not None for m in media) else None

    def column(self, name: str) -> list[list]:
        """A per-token field of every sample (`Sample.token_fields[name]`); KeyError naming the sample that
        lacks it."""
        out = []
        for i, s in enumerate(self.samples):
            if name not in s.token_fields:
                raise KeyError(f"sequence {i} ({s.where}) has no per-token field {name!r}")
            out.append(s.token_fields[name])
        return out

    def select(self, rows: list[int]) -> TrainBatch:
        return TrainBatch([self.samples[i] for i in rows])

    def policy_tokens(self) -> int:
        """Response tokens that carry loss (the loss's token denominator)."""
        return sum(s.policy_tokens for s in self.samples)

    def split_by_groups(self, parts: int) -> list[TrainBatch]:
        """`parts` minibatches holding whole groups (a group's samples stay together), near-equal in groups."""
        groups = sorted(set(self.group_ids))
        chunks = [set(groups[k::parts]) for k in range(parts)]
        return [self.select([i for i, g in enumerate(self.group_ids) if g in chunk]) for chunk in chunks if chunk]


class Packed(NamedTuple):
    input_ids: torch.Tensor  # [1, N]
    cu_seqlens: torch.Tensor  # [B + 1] int32
    positions: torch.Tensor  # [M] packed positions whose hidden state predicts a response token
    targets: torch.Tensor  # [M]
    rows: torch.Tensor  # [M] sequence index of each response token
    cols: torch.Tensor  # [M] index inside its response
    shape: tuple[int, int]  # (B, T)
    loss_mask: torch.Tensor  # [M] bool: the token carries loss (the policy's, not the environment's)
    media: MediaEmbeds | None = None  # image features at their packed pad positions; None: no image in the row
    # the engine's expert ids of every packed token [N, MoE layers, top_k] (-1: no record); None: none recorded
    routing: torch.Tensor | None = None

    def to_padded(self, flat: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[M] per response token -> [B, T], `fill` off the mask."""
        out = flat.new_full(self.shape, fill)
        out[self.rows, self.cols] = flat
        return out

    def mask(self) -> torch.Tensor:
        """[B, T] bool: the response tokens that carry loss (padding and environment tokens False)."""
        m = torch.zeros(self.shape, dtype=torch.bool, device=self.rows.device)
        m[self.rows, self.cols] = self.loss_mask
        return m

    @property
    def policy_tokens(self) -> int:
        return int(self.loss_mask.sum())


def pack(batch: TrainBatch, device: torch.device | str) -> Packed:
    ids, cu, positions, targets, rows, cols, keep = [], [0], [], [], [], [], []
    pads: list[int] = []
    features: list[torch.Tensor] = []
    for i, s in enumerate(batch.samples):
        p, r, m = s.prompt_ids, s.output_ids, s.loss_mask
        start = cu[-1]
        if s.media is not None:
            pads += [start + q for q in s.media.positions]
            features.append(s.media.features)
        ids += p + r
        cu.append(start + len(p) + len(r))
        first = start + len(p) - 1
        positions += range(first, first + len(r))
        targets += r
        rows += [i] * len(r)
        cols += range(len(r))
        keep += [bool(x) for x in m]
    t = max(len(r) for r in batch.responses)

    def tensor(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    media = None
    if features:
        from miles_k3.model.modeling import MediaEmbeds

        media = MediaEmbeds(tensor(pads), torch.cat(features).to(device))
    return Packed(
        tensor([ids]),
        tensor(cu, torch.int32),
        tensor(positions),
        tensor(targets),
        tensor(rows),
        tensor(cols),
        (len(batch), t),
        tensor(keep, torch.bool),
        media,
        _routing(batch, cu[-1], device),
    )


def _routing(batch: TrainBatch, tokens: int, device: torch.device | str) -> torch.Tensor | None:
    """The samples' routing tables laid end to end as the packed row ([tokens, MoE layers, top_k], -1 where a
    sample has no record), or None when no sample has one."""
    tables = [s.routed_experts for s in batch.samples]
    given = [t for t in tables if t is not None]
    if not given:
        return None
    out = torch.full((tokens, *given[0].shape[1:]), -1, dtype=torch.int16)
    start = 0
    for s, t in zip(batch.samples, tables):
        if t is not None:
            out[start : start + t.shape[0]] = t
        start += len(s.prompt_ids) + len(s.output_ids)
    return out.to(device)
