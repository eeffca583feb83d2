"""A training batch of finished rollouts, and its packed form for one varlen forward.

Sequence i is prompt_i + response_i. All sequences are packed into one row [1, N] with `cu_seqlens`, so no
padding is computed. Response token k of sequence i sits at packed position p = start_i + len(prompt_i) + k
and is predicted by the hidden state at p - 1; `positions` lists those predicting positions, `targets` the
tokens. Per-token results come back as [B, T] (T = the longest response) with `mask` marking the tokens that
carry loss, the layout `miles_k3.algo` takes.

Multi-turn samples (`rollout.fn`) carry a loss mask per response token: the policy's tokens (True) carry loss,
the environment's (tool output: False) are still part of the packed row, so the model reads them as context,
and their log-probs are computed alongside, but `mask()` leaves them out of the loss, TIS and every metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


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

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: list[int]) -> TrainBatch:
        return TrainBatch([self.prompts[i] for i in rows], [self.responses[i] for i in rows],
                          [self.rollout_logprobs[i] for i in rows], [self.advantages[i] for i in rows],
                          [self.group_ids[i] for i in rows],
                          None if self.loss_masks is None else [self.loss_masks[i] for i in rows])

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
    masks = batch.loss_masks or [None] * len(batch)
    for i, (p, r, m) in enumerate(zip(batch.prompts, batch.responses, masks)):
        start = cu[-1]
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

    return Packed(tensor([ids]), tensor(cu, torch.int32), tensor(positions), tensor(targets), tensor(rows),
                  tensor(cols), (len(batch), t), tensor(keep, torch.bool))
