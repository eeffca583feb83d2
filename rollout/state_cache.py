"""`K3StateCache` over the engine's pools: a batch of requests at different positions.

One model step runs N requests. Two layouts:

- decode: input [N, 1], one new token per request;
- packed prefill: input [1, sum T_n], request n's T_n new tokens back to back (`cu_seqlens` marks them).

Everything the layers need is a device tensor built once per step (`BatchLayout`), so a step pays a few
host-to-device copies, not per-request indexing, and a decode step can be replayed as a CUDA graph with
the layout's tensors as its static inputs. KDA state stays in each request's working slot (`PooledState`:
the short conv and `kda` ops step it there). MLA KV rows are written into the request's pages, and the cache
answers the MLA layer's `mla_attention` itself: attention in the absorbed form straight over the pages
(`rollout.attention`), so no per-step key/value expansion of the history is needed and the layer never asks
for `mla_extend`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from miles_k3.model.cache import KDAState
from miles_k3.ops import exact
from miles_k3.ops.kda import PooledState
from rollout import dcp
from rollout.attention import absorbed_attention, expanded_attention
from rollout.memory import KDAStatePool, KVPagePool
from rollout.transfer import host_tensor, to_device


def _page_table(page_tables: list[list[int]], width: int, fill: int) -> torch.Tensor:
    """[N, width] int64: each row's first `width` pages, then `fill`. Built from one flat buffer and a mask:
    a nested torch.tensor of a batch-256 step's tables took 1-2 ms of the host's step on the H200."""
    rows = [t if len(t) <= width else t[:width] for t in page_tables]
    flat = list(itertools.chain.from_iterable(rows))
    table = torch.full((len(rows), width), fill, dtype=torch.long)
    if flat:
        filled = torch.arange(width)[None, :] < host_tensor([len(t) for t in rows])[:, None]
        table[filled] = host_tensor(flat, torch.long)
    return table


@dataclass
class BatchLayout:
    """Device tensors describing one step (N requests, padded query length Tq, padded history length S).

    The step's inputs (what a CUDA graph's static layout is refilled with each replay, `copy_`):
    slot_index [N]       KDA working slot per request (padding rows: the pool's sink slot)
    write_rows [Ttok]    KV row for each new token, in input order (padding rows: the sink page)
    page_table [N, P]    each request's first P = ceil(S / page_size) pages (past its table: the zero page)
    ends       [N]       each request's history length after the step (positions + new tokens)
    q_pos      [N, Tq]   absolute position of each (padded) query; a padded query gets 0 and so sees only
                         key 0, which keeps its softmax finite; its output is discarded
    q_index    [N, Tq]   input token index of each padded query (padding: 0)
    out_index  [Ttok]    index into the flattened [N * Tq] padded queries of each input token
    and its shape: `hist_len` S and the DCP rank whose positions the pool keeps.

    Derived on the device by `with_history` (`PoolStateCache` does it once per step, inside a captured graph
    too, so a replay refills [N, P] page numbers rather than copying [N, S] rows from the host):
    hist_rows  [N, S]    KV row of each history position 0..S-1 (beyond a request's end: the zero page); under
                         DCP (n ranks) S = ceil(S / n) and slot j is this rank's position j * n + rank
    """

    slot_index: torch.Tensor
    write_rows: torch.Tensor
    page_table: torch.Tensor
    ends: torch.Tensor
    q_pos: torch.Tensor
    q_index: torch.Tensor
    out_index: torch.Tensor
    hist_len: int
    dcp_rank: int = 0
    hist_rows: torch.Tensor | None = None

    INPUTS = ("slot_index", "write_rows", "page_table", "ends", "q_pos", "q_index", "out_index")

    @staticmethod
    def build(
        kv: KVPagePool,
        slots: list[int],
        positions: list[int],
        lengths: list[int],
        page_tables: list[list[int]],
        device: torch.device,
        hist_len: int | None = None,
        dcp_rank: int = 0,
    ) -> "BatchLayout":
        """Request n has computed positions [0, positions[n]) and brings lengths[n] new tokens; its page
        table must cover [0, positions[n] + lengths[n]). Inputs are ordered request by request. `hist_len`
        pads the history to a fixed S (CUDA-graph buckets); default: the longest request. A pool that keeps
        a DCP rank's rows (`kv.rows_per_page` < page_size) maps only the positions of `dcp_rank`
        (`rollout.dcp`). The host builds what grows with the step's tokens (N x Tq) and the page tables
        (N x S / page_size); the history rows are left to `with_history`."""
        page = kv.page_size
        n = len(slots)
        ends = [p + t for p, t in zip(positions, lengths)]
        s = max(ends) if hist_len is None else hist_len
        assert s >= max(ends)
        pages_needed = -(-s // page)
        zero = kv.zero_page
        table = _page_table(page_tables, pages_needed, zero)  # [N, P]
        tq = max(lengths)
        t = torch.arange(tq)
        q_valid = t[None, :] < torch.tensor(lengths)[:, None]  # [N, Tq]
        starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
        q_index = torch.where(q_valid, starts[:, None] + t[None, :], 0)
        q_pos = torch.where(q_valid, torch.tensor(positions)[:, None] + t[None, :], 0)
        dcp_size = page // kv.rows_per_page  # 1 without DCP
        if dcp_size == 1:  # rows of the new tokens, input order (a valid query's position is within its table)
            write = (table.gather(1, q_pos // page) * page + q_pos % page)[q_valid]
        else:  # DCP: this rank's positions only
            write = dcp.write_rows(table, q_pos, q_valid, page, dcp_size, dcp_rank, kv.sink_page)
        out_index = (torch.arange(n)[:, None] * tq + t[None, :])[q_valid]
        inputs = (to_device(x, device, torch.long) for x in (slots, write, table, ends, q_pos, q_index, out_index))
        return BatchLayout(*inputs, hist_len=s, dcp_rank=dcp_rank)

    def with_history(self, kv: KVPagePool) -> "BatchLayout":
        """This layout with `hist_rows` computed from the page tables on their device (a few kernels)."""
        page, zero = kv.page_size, kv.zero_page
        dcp_size = page // kv.rows_per_page
        table, s = self.page_table, self.hist_len
        if dcp_size == 1:
            key = torch.arange(s, device=table.device)
            hist = table[:, key // page] * page + key % page  # [N, S]
            hist = torch.where(key[None, :] < self.ends[:, None], hist, zero * page)
        else:
            hist = dcp.history_rows(table, self.ends, s, page, dcp_size, self.dcp_rank, zero)
        return dataclasses.replace(self, hist_rows=hist)

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.INPUTS]

    def to(self, device: torch.device | str) -> "BatchLayout":
        """This layout's inputs on `device`, copied asynchronously (`rollout.transfer`)."""
        return BatchLayout(
            *(to_device(t, device) for t in self._tensors()), hist_len=self.hist_len, dcp_rank=self.dcp_rank
        )

    def copy_(self, other: "BatchLayout") -> None:
        """Write `other`'s inputs into these tensors in place (a CUDA graph's static inputs), asynchronously."""
        assert (other.hist_len, other.dcp_rank) == (self.hist_len, self.dcp_rank)
        for dst, src in zip(self._tensors(), other._tensors()):
            dst.copy_(src, non_blocking=True)


class PoolStateCache:
    """Built per model step from a `BatchLayout`; `page_tables[n]` must already cover the step's tokens."""

    def __init__(self, kv: KVPagePool, states: KDAStatePool, layout: BatchLayout):
        self.kv, self.states, self.layout = kv, states, layout.with_history(kv)
        self._hidden_keys: dict[int, torch.Tensor] = {}  # history length -> the step's causal mask

    def kda_state(self, layer_idx: int) -> KDAState:
        """The requests' slots themselves (`PooledState`s of the conv pool's q / k / v planes and of the
        recurrent pool), which the short conv and `kda` ops step in place: no gathered copies and no
        scatter back (at batch 256 on k3-small those moved 0.5 GB a KDA layer a decode step, and at batch 1
        they were five of a KDA layer's launches)."""
        idx, conv = self.layout.slot_index, self.states.conv[layer_idx]
        return KDAState(
            *(PooledState(conv[:, i], idx) for i in range(3)), PooledState(self.states.recurrent[layer_idx], idx)
        )

    def set_kda_state(self, layer_idx: int, state: KDAState) -> None:
        """Nothing to copy: the ops stepped the slots in place and handed back the `PooledState`s."""
        assert all(isinstance(part, PooledState) for part in state), "a KDA op returned a copy of its pooled state"

    def hidden_keys(self, hist_len: int) -> torch.Tensor:
        """[N, 1, Tq, S] bool: which of the S history positions each query of the step may not see (those
        after its own position). The same for every MLA layer of the step, so built once per step (this
        cache lives for one step, inside a captured CUDA graph too) rather than once per layer."""
        if hist_len not in self._hidden_keys:
            q_pos = self.layout.q_pos
            key_pos = torch.arange(hist_len, device=q_pos.device)
            self._hidden_keys[hist_len] = key_pos[None, None, None, :] > q_pos[:, None, :, None]
        return self._hidden_keys[hist_len]

    def mla_store(self, layer_idx: int, latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Store this step's normed latent [B, T, R] and shared key part [B, T, Dr] (input order) in their
        pages; returns the layer's page buffer [rows, R + Dr], which `layout.hist_rows` indexes."""
        buf = self.kv.buffers[layer_idx]
        new = torch.cat([latent, rope], dim=-1).reshape(-1, buf.shape[-1]).to(buf.dtype)
        buf.index_copy_(0, self.layout.write_rows, new)
        return buf

    def mla_attention(self, mixer, q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """The absorbed attention over this step's requests' pages (writes the step's rows first); in exact
        mode the expanded one, as the trainer computes it (`rollout.attention.expanded_attention`)."""
        if exact.enabled():
            return expanded_attention(mixer, q, latent, rope, self)
        return absorbed_attention(mixer, q, latent, rope, self)

    def advance(self, num_tokens: int) -> None:
        pass  # positions are the scheduler's; this cache lives for one step
