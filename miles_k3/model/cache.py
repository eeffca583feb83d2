"""State handling for incremental decoding: the protocol layers call, and the dense reference.

Layers see state only through `K3StateCache`, so the rollout engine can supply
paged KV and slot-indexed KDA state without touching the math. The reference
`DenseStateCache` holds one batch of equal-length sequences in plain tensors.

Call order per forward (one model step over T new tokens): each KDA layer
calls `kda_state` then `set_kda_state` once; each MLA layer calls
`mla_attention` once and, when that returns None, `mla_extend` once; the
model calls `advance(T)` after the last layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from miles_k3.model.config import K3Config
from miles_k3.ops.mla import causal_mask

if TYPE_CHECKING:
    from miles_k3.model.layers import MLAMixer


class KDAState(NamedTuple):
    """One KDA layer's carried state: conv histories [B, H*K, W-1] for q, k, v (the last W-1 pre-conv
    inputs), and the recurrent state [B, H, K, V] in fp32, or a `miles_k3.ops.kda.PooledState` (rows of a
    cache's pool, which the `kda` op updates in place and hands back as the final state), or a
    `miles_k3.ops.kda.FrozenRows` (rows of a pool the op only reads: its final state is None)."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor


class K3StateCache(Protocol):
    def kda_state(self, layer_idx: int) -> KDAState | None:
        """The state before this step, or None for a fresh sequence (zero history)."""

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        """Store the state after this step. The cache may copy into its own storage."""

    def mla_attention(
        self, mixer: "MLAMixer", q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor
    ) -> torch.Tensor | None:
        """The MLA layer's attention computed by the cache in its own storage form, or None to have the
        layer run its reference attention over the history `mla_extend` returns. q [B, T, H, Dqk], this
        step's normed latent [B, T, R] and shared key part [B, T, Dr] -> output [B, T, H, Dv]; the cache
        stores the step's latent and key part itself. `mixer` gives the layer's weights and shapes
        (kv_b_proj, heads, scale, layer_idx). The rollout engine answers with absorbed attention over its
        KV pages; the dense reference returns None."""

    def mla_extend(
        self, layer_idx: int, latent: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append this step's normed KV latent [B, T, R] and shared key part [B, T, Dr]; return the full
        history (latent [B, S, R], rope [B, S, Dr]) and a bool mask [B|1, 1|H, T, S] (True = attend),
        or None when T == S and plain causal attention applies."""

    def advance(self, num_tokens: int) -> None:
        """Called once per model step after all layers."""


class DenseStateCache:
    """Reference cache: a batch of B sequences, all at the same position."""

    def __init__(self, config: K3Config):
        self.config = config
        self.seq_len = 0
        self._kda: dict[int, KDAState] = {}
        self._latent: dict[int, torch.Tensor] = {}
        self._rope: dict[int, torch.Tensor] = {}

    def kda_state(self, layer_idx: int) -> KDAState | None:
        return self._kda.get(layer_idx)

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        self._kda[layer_idx] = state

    def mla_attention(self, mixer, q, latent, rope) -> None:
        return None  # the layer's reference attention over `mla_extend`'s history

    def mla_extend(self, layer_idx, latent, rope):
        if layer_idx in self._latent:
            latent = torch.cat([self._latent[layer_idx], latent], dim=1)
            rope = torch.cat([self._rope[layer_idx], rope], dim=1)
        self._latent[layer_idx], self._rope[layer_idx] = latent, rope
        t, s = latent.shape[1] - self.seq_len, latent.shape[1]
        return latent, rope, None if t == s else causal_mask(t, s, latent.device)

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens
