"""A training batch of finished rollouts, and its packed form for one varlen forward.

Sequence i is prompt_i + response_i. All sequences are packed into one row [1, N] with `cu_seqlens`, so no
padding is computed. Response token k of sequence i sits at packed position p = start_i + len(prompt_i) + k
and is predicted by the hidden state at p - 1; `positions` lists those predicting positions, `targets` the
tokens. Per-token results come back as [B, T] (T = the longest response) with `mask` marking the tokens that
carry loss, the layout `miles_k3.algo` takes.

Multi-turn samples (`rollout.fn`) carry a loss mask per response token: the policy's tokens (True) carry loss,
the environment's (tool output: False) are still part of the packed row, so the model reads them as context,
and their log-probs are computed alongside, but `mask()` leaves them out of the loss, TIS and every metric.

Image prompts carry their media per sequence (`SequenceMedia`: the prompt positions of its media pads and the
projected features that replace their embeddings, the very features the engine was given); `pack` places
them in the packed row (`Packed.media`, a `MediaEmbeds` over packed positions: start_i + the pad's prompt
position), which the first pipeline stage splices in. The n samples of a prompt share one `SequenceMedia`
(one tensor, pickled once when the batch travels to the trainer ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from miles_k3.model.modeling import MediaEmbeds


class SequenceMedia(NamedTuple):
    """A prompt's images as the trainer sees them: the prompt positions of its media pad tokens (ascending)
    and their features [len(positions), D] (CPU; the rows in pad order, image after image)."""

    positions: tuple[int, ...]
    features: torch.Tensor


@dataclass
class TrainBatch:
    prompts: list[list[int]]
    responses: list[list[int]]  # >= 1 token each
    rollout_logprobs: list[list[float]]  # the engine's log-prob of each response token
    advantages: list[float]  # one per sequence
    group_ids: list[int]
    # per response token: True = the policy's (carries loss), False = the environment's (context only);
    # None: every response token is the policy's (single-turn rollouts)
    loss_masks: list[list[bool]] | None = None
    # per sequence: its prompt's images (None for a text prompt); None: a text-only batch
    media: list[SequenceMedia | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompts)
        lengths = {len(self.responses), len(self.rollout_logprobs), len(self.advantages), len(self.group_ids)}
        assert lengths == {n}, f"batch fields disagree in length: {n} prompts, others {lengths}"
        for i, (r, lp) in enumerate(zip(self.responses, self.rollout_logprobs)):
            assert r and len(r) == len(lp), f"sequence {i}: {len(r)} response tokens, {len(lp)} log-probs"
        if self.loss_masks is not None:
            assert len(self.loss_masks) == n, f"{n} sequences, {len(self.loss_masks)} loss masks"
            for i, (r, m) in enumerate(zip(self.responses, self.loss_masks)):
                assert len(m) == len(r) and any(m), f"sequence {i}: {len(r)} tokens, mask {m} (>= 1 policy token)"
        if self.media is not None:
            assert len(self.media) == n, f"{n} sequences, {len(self.media)} media entries"
            for i, (p, m) in enumerate(zip(self.prompts, self.media)):
                if m is not None:
                    assert tuple(m.features.shape[:1]) == (len(m.positions),) and all(
                        0 <= q < len(p) for q in m.positions), f"sequence {i}: media {len(m.positions)} pads at " \
                        f"{m.positions[:4]}..., features {tuple(m.features.shape)}, prompt of {len(p)} tokens"

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: list[int]) -> TrainBatch:
        return TrainBatch([self.prompts[i] for i in rows], [self.responses[i] for i in rows],
                          [self.rollout_logprobs[i] for i in rows], [self.advantages[i] for i in rows],
                          [self.group_ids[i] for i in rows],
                          None if self.loss_masks is None else [self.loss_masks[i] for i in rows],
                          None if self.media is None else [self.media[i] for i in rows])

    def policy_tokens(self) -> int:
        """Response tokens that carry loss (the loss's token denominator)."""
        if self.loss_masks is None:
            return sum(len(r) for r in self.responses)
        return sum(sum(map(bool, m)) for m in self.loss_masks)

    def split_by_groups(self, parts: int) -> list[TrainBatch]:
        """`parts` minibatches holding whole groups (a group's samples stay together), near-equal in groups."""
        groups = sorted(set(self.group_ids))
        chunks = [set(groups[k::parts]) for k in range(parts)]
        return [self.select([i for i, g in enumerate(self.group_ids) if g in chunk]) for chunk in chunks
                if chunk]


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
    masks = batch.loss_masks or [None] * len(batch)
    for i, (p, r, m) in enumerate(zip(batch.prompts, batch.responses, masks)):
        start = cu[-1]
        if batch.media is not None and batch.media[i] is not None:
            pads += [start + q for q in batch.media[i].positions]
            features.append(batch.media[i].features)
        ids += p + r
        cu.append(start + len(p) + len(r))
        first = start + len(p) - 1
        positions += range(first, first + len(r))
        targets += r
        rows += [i] * len(r)
        cols += range(len(r))
        keep += [True] * len(r) if m is None else [bool(x) for x in m]
    t = max(len(r) for r in batch.responses)

    def tensor(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    media = None
    if features:
        from miles_k3.model.modeling import MediaEmbeds

        media = MediaEmbeds(tensor(pads), torch.cat(features).to(device))
    return Packed(tensor([ids]), tensor(cu, torch.int32), tensor(positions), tensor(targets), tensor(rows),
                  tensor(cols), (len(batch), t), tensor(keep, torch.bool), media)
