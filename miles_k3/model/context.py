"""The seam for context parallelism: this rank's share of a sequence split over a CP group.

A context-parallel build (`megatron_patches.context_parallel`) splits every packed row over `size` ranks
in megatron's load-balanced zigzag order (`ZigzagLayout`) and passes a `ContextParallel` subclass into the
model, like the `TensorParallel` share of `miles_k3.model.linear`. Linears, adapters, norms, AttnRes and the
MoE are per token and never consult it; only the sequence mixers do, through the methods below:

- KDA runs on contiguous segments: `to_segment` / `to_zigzag` move its input and output between the zigzag
  layout and rank r's contiguous segment (tokens [2rc, 2rc + 2c) of the padded row, chunk size c), and
  `short_conv` / `kda` take the previous rank's conv inputs and recurrent state.
- MLA attends over every rank's keys: `mla_keys` brings every rank's latent KV in sequence order and the
  mask of which keys each local query sees.

The base class is the single-device case: one rank, the whole sequence, every method the plain op, so the
mixers run exactly as without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from miles_k3.ops.kda import kda
from miles_k3.ops.short_conv import causal_short_conv, causal_short_convs


class ContextParallel:
    """`size` ranks share each sequence; this one is `rank`. The base class (size 1) is no split."""

    def __init__(self, size: int = 1, rank: int = 0):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"ContextParallel: need size >= 1 and 0 <= rank < size, got size={size}, rank={rank}")
        self.size, self.rank = size, rank

    def to_segment(self, x: torch.Tensor) -> torch.Tensor:
        """KDA's input [1, 2c, ...] in zigzag order -> this rank's contiguous segment (identity here)."""
        return x

    def to_zigzag(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_segment` (identity here)."""
        return x

    def short_conv(
        self, x: torch.Tensor, weight: torch.Tensor, *, state: torch.Tensor | None, cu_seqlens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`causal_short_conv` over this rank's segment, with the previous tokens of a sequence that started
        on an earlier rank."""
        return causal_short_conv(x, weight, state=state, cu_seqlens=cu_seqlens)

    def short_convs(
        self, xs: list[torch.Tensor], weights: list[torch.Tensor], *, states: list, cu_seqlens: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`short_conv` of each (x, weight, state): a KDA layer's q, k, v, in one kernel launch where the
        op's kernel takes them (`causal_short_convs`). A split subclass overrides this with its own."""
        return causal_short_convs(xs, weights, states=states, cu_seqlens=cu_seqlens)

    def kda(self, q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
        """The `kda` op over this rank's segment, starting from the state an earlier rank's part of the
        sequence left."""
        return kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm,
        )

    def mla_keys(
        self, latent: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """MLA's latent [B, S, R] and shared key part [B, S, Dr] of every rank in sequence order, and the
        attention mask over them (None = plain causal, or `mask` as a cache gave it). Identity here."""
        return latent, rope, mask


NO_CP = ContextParallel()


@dataclass(frozen=True)
class ZigzagLayout:
    """Where rank `rank` of `size` holds the tokens of one packed row, in megatron's load-balanced order.

    The row (N real tokens, sequences `cu_seqlens`) is padded at the end to a multiple of 2 * size (the
    padding a sequence of its own, so no real token sees it) and cut into 2 * size chunks of `chunk`
    tokens; rank r holds chunks r and 2 * size - 1 - r, in that order (early and late positions, so causal
    attention costs every rank the same). `positions` are the global positions of the local tokens.
    KDA instead works on rank r's contiguous segment, chunks 2r and 2r + 1 (`segment`).
    """

    size: int
    rank: int
    num_tokens: int  # N, the real tokens of the row
    bounds: tuple[int, ...]  # sequence boundaries of the padded row: 0 ... N [, padded]

    @classmethod
    def split(cls, num_tokens: int, cu_seqlens: torch.Tensor | None, size: int, rank: int) -> "ZigzagLayout":
        """The layout of a row of `num_tokens` tokens holding the sequences `cu_seqlens` ([M+1], None = one
        sequence) for rank `rank` of `size`."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"ZigzagLayout: need size >= 1 and 0 <= rank < size, got size={size}, rank={rank}")
        bounds = [0, num_tokens] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != num_tokens or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to {num_tokens}, got {bounds}")
        if num_tokens < 1:
            raise ValueError("context parallelism needs a row of at least one token")
        bounds = sorted(set(bounds))  # empty sequences hold no token
        padded = num_tokens + (-num_tokens % (2 * size))
        if padded > num_tokens:
            bounds.append(padded)
        return cls(size, rank, num_tokens, tuple(bounds))

    @property
    def padded(self) -> int:
        return self.bounds[-1]

    @property
    def chunk(self) -> int:
        return self.padded // (2 * self.size)

    @property
    def local_len(self) -> int:
        return 2 * self.chunk

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The chunks rank `rank` holds, in its local order."""
        return rank, 2 * self.size - 1 - rank

    def positions_of(self, rank: int) -> torch.Tensor:
        """Global positions [2c] of rank `rank`'s local tokens (ascending)."""
        c = self.chunk
        return torch.cat([torch.arange(j * c, (j + 1) * c) for j in self.chunks_of(rank)])

    @cached_property
    def positions(self) -> torch.Tensor:
        return self.positions_of(self.rank)

    @cached_property
    def real(self) -> torch.Tensor:
        """Bool [2c]: the local token is a real one (not padding)."""
        return self.positions < self.num_tokens

    @cached_property
    def sequence_ids(self) -> torch.Tensor:
        """Long [padded]: the sequence of every position of the padded row."""
        cu = torch.tensor(self.bounds)
        return torch.searchsorted(cu[1:], torch.arange(self.padded), right=True)

    def shard(self, x: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
        """This rank's tokens of a tensor laid out like the row (N along `dim`): input ids, targets, masks.
        Padding positions hold `pad_value`."""
        if x.shape[dim] != self.num_tokens:
            raise ValueError(f"shard: dim {dim} has {x.shape[dim]} entries, the row has {self.num_tokens} tokens")
        dim = dim % x.dim()
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, self.padded - self.num_tokens]
        return F.pad(x, pad, value=pad_value).index_select(dim, self.positions.to(x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Every rank's local tensors (rank order, 2c along `dim`) -> the row's N entries in order."""
        if len(parts) != self.size:
            raise ValueError(f"unshard: need one part per rank ({self.size}), got {len(parts)}")
        return (
            torch.cat(parts, dim=dim)
            .index_select(dim, self.row_order.to(parts[0].device))
            .narrow(dim, 0, self.num_tokens)
        )

    @cached_property
    def row_order(self) -> torch.Tensor:
        """Long [padded]: where each position of the padded row sits in the ranks' local tokens concatenated
        in rank order (gather them, then index with this to get row order)."""
        return torch.cat([self.positions_of(r) for r in range(self.size)]).argsort()

    # --- KDA's contiguous segments ---

    def segment_of(self, rank: int) -> tuple[int, int]:
        """Rank `rank`'s contiguous KDA segment [start, end) of the padded row: chunks 2r and 2r + 1."""
        return 2 * rank * self.chunk, 2 * (rank + 1) * self.chunk

    @property
    def segment(self) -> tuple[int, int]:
        return self.segment_of(self.rank)

    def segment_bounds_of(self, rank: int) -> list[int]:
        """Sequence boundaries inside rank `rank`'s segment, re-based to it: [0, ..., 2c]."""
        start, end = self.segment_of(rank)
        return [0, *(b - start for b in self.bounds if start < b < end), end - start]

    def continues(self, rank: int) -> bool:
        """Rank `rank`'s segment starts inside a sequence that began on an earlier segment."""
        return rank > 0 and self.segment_of(rank)[0] not in self.bounds

    def segment_start_of_sequence(self, rank: int) -> int:
        """Global position where the sequence of rank `rank`'s first segment token begins."""
        start = self.segment_of(rank)[0]
        return max(b for b in self.bounds if b <= start)

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """Bool [2c, padded]: local query i (global position p_i) sees key j iff j <= p_i in its sequence."""
        seq = self.sequence_ids
        keys = torch.arange(self.padded)
        return (keys[None, :] <= self.positions[:, None]) & (seq[None, :] == seq[self.positions][:, None])
