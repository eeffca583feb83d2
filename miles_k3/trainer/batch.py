"""A training batch of finished rollouts, and its packed form for one varlen forward.

Sequence i is prompt_i + response_i. All sequences are packed into one row [1, N] with `cu_seqlens`, so no
padding is computed. Response token k of sequence i sits at packed position p = start_i + len(prompt_i) + k
and is predicted by the hidden state at p - 1; `positions` lists those predicting positions, `targets` the
tokens. Per-token results come back as [B, T] (T = the longest response) with `mask` marking real tokens,
the layout `miles_k3.algo` takes.
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

    def __post_init__(self) -> None:
        n = len(self.prompts)
        lengths = {len(self.responses), len(self.rollout_logprobs), len(self.advantages), len(self.group_ids)}
        assert lengths == {n}, f"batch fields disagree in length: {n} prompts, others {lengths}"
        for i, (r, lp) in enumerate(zip(self.responses, self.rollout_logprobs)):
            assert r and len(r) == len(lp), f"sequence {i}: {len(r)} response tokens, {len(lp)} log-probs"

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: list[int]) -> TrainBatch:
        return TrainBatch([self.prompts[i] for i in rows], [self.responses[i] for i in rows],
                          [self.rollout_logprobs[i] for i in rows], [self.advantages[i] for i in rows],
                          [self.group_ids[i] for i in rows])

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

    def to_padded(self, flat: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[M] per response token -> [B, T], `fill` off the mask."""
        out = flat.new_full(self.shape, fill)
        out[self.rows, self.cols] = flat
        return out

    def mask(self) -> torch.Tensor:
        m = torch.zeros(self.shape, dtype=torch.bool, device=self.rows.device)
        m[self.rows, self.cols] = True
        return m


def pack(batch: TrainBatch, device: torch.device | str) -> Packed:
    ids, cu, positions, targets, rows, cols = [], [0], [], [], [], []
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
        start = cu[-1]
        ids += p + r
        cu.append(start + len(p) + len(r))
        first = start + len(p) - 1
        positions += range(first, first + len(r))
        targets += r
        rows += [i] * len(r)
        cols += range(len(r))
    t = max(len(r) for r in batch.responses)

    def tensor(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    return Packed(tensor([ids]), tensor(cu, torch.int32), tensor(positions), tensor(targets), tensor(rows),
                  tensor(cols), (len(batch), t))
