"""`K3StateCache` over the engine's pools: a batch of requests at different positions.

One model step runs B requests, each with T new tokens (T = 1 for decode; B = 1 for a prefill chunk).
KDA state is read from and written back to each request's working slot (a gather and a scatter on the
stream); MLA KV rows are written into the request's pages at its positions and the history is gathered
back, padded to the longest request, with a mask that hides padding and future positions.
"""

from __future__ import annotations

import torch

from miles_k3.model.cache import KDAState
from rollout.memory import KDAStatePool, KVPagePool


class PoolStateCache:
    """Built per model step. `page_tables[b]` must already cover positions [0, positions[b] + T)."""

    def __init__(self, kv: KVPagePool, states: KDAStatePool, slots: list[int], positions: list[int],
                 page_tables: list[list[int]]):
        assert len(slots) == len(positions) == len(page_tables)
        self.kv, self.states = kv, states
        device = next(iter(states.recurrent.values())).device if states.recurrent else "cpu"
        self.slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        self.positions = positions
        self.page_tables = page_tables

    def kda_state(self, layer_idx: int) -> KDAState:
        conv = self.states.conv[layer_idx].index_select(0, self.slot_index)
        return KDAState(*conv.unbind(1), self.states.recurrent[layer_idx].index_select(0, self.slot_index))

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        conv = torch.stack([state.conv_q, state.conv_k, state.conv_v], dim=1)
        self.states.conv[layer_idx].index_copy_(0, self.slot_index, conv.to(self.states.conv[layer_idx].dtype))
        self.states.recurrent[layer_idx].index_copy_(0, self.slot_index, state.recurrent.float())

    def mla_extend(self, layer_idx, latent, rope):
        b, t, r = latent.shape
        buf = self.kv.buffers[layer_idx]
        new = torch.cat([latent, rope], dim=-1).to(buf.dtype)
        lengths = [p + t for p in self.positions]
        s = max(lengths)
        hist = buf.new_zeros(b, s, buf.shape[-1])
        for i, (pos, table) in enumerate(zip(self.positions, self.page_tables)):
            buf.index_copy_(0, self.kv.rows(table, pos, pos + t), new[i])
            hist[i, : pos + t] = buf.index_select(0, self.kv.rows(table, 0, pos + t))
        hist = hist.to(latent.dtype)
        key_pos = torch.arange(s, device=latent.device)
        q_pos = torch.tensor(self.positions, device=latent.device)[:, None] + torch.arange(t, device=latent.device)
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, T, S]; padding lies beyond every query
        return hist[..., :r], hist[..., r:], mask[:, None]

    def advance(self, num_tokens: int) -> None:
        pass  # positions are the scheduler's; this cache lives for one step
