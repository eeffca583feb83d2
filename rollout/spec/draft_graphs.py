"""CUDA-graph drafting: a DSpark drafter's greedy block proposal replayed from a graph, by batch bucket.

A block proposal is a few hundred small eager ops (two draft layers over the context windows, then per draft
position the Markov head, the confidence head and the draw): on the H200, 2026-12-04, 3.9 ms of host time a
step at batch 1, the largest part of a speculative step once the verify forward and the fold were graphs. For
an all-greedy batch the whole proposal is a function of two device tensors, the rows of the drafter's
context buffer (`ContextWindows.read_rows`) and the anchors, so it is captured once per (batch bucket, gamma)
and replayed with those copied into its static inputs. Sampled rows draw with their requests' temperature,
top-k / top-p and noise streams, which the draw reads from host lists: such batches propose eagerly.

Padding: a batch is padded to its bucket with buffer row 0 and token 0; the padded rows' drafts are computed
and dropped. Graphs read the context buffer by address, so a buffer that grew (`ContextWindows._grow`) drops
them. A bucket is captured on its third ask and a larger captured graph serves it until then
(`rollout.forward.GraphChoice`, as the decode and verify graphs do). `capture=False` runs the padded shapes
eagerly: the CPU tests' way to check padding and bucketing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rollout.forward import GraphChoice, _bucket, capture_graph
from rollout.spec.graphs import BATCH_BUCKETS

log = logging.getLogger(__name__)

# propose(idx [B], anchors [B], gamma) -> (drafts [B, gamma], confidences [B, gamma]), all rows greedy
Propose = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class DraftGraphs:
    """Greedy block proposals over one context buffer (`buffer()` returns the tensor the graphs read; when it
    is another tensor, the graphs are dropped)."""

    def __init__(self, propose: Propose, buffer: Callable[[], torch.Tensor], max_batch: int, capture: bool):
        self.propose, self.buffer, self.capture = propose, buffer, capture
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        # (batch bucket, 0, gamma) -> (graph, idx, anchors, drafts, confidences); the 0 stands where the decode
        # graphs' keys hold a history bucket, so `GraphChoice` compares the keys the same way
        self.graphs: dict[tuple, tuple | None] = {}
        self.choice = GraphChoice()
        self._read: torch.Tensor | None = None  # the buffer the graphs were captured over
        self.failed = False
        self.captures = self.replays = 0

    def usable(self, n: int) -> bool:
        return not self.failed and _bucket(n, self.batch_buckets) is not None

    def run(self, rows: list[int], anchors: torch.Tensor, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [N, gamma] and confidences [N, gamma] of N greedy rows (buffer rows `rows`, anchors [N] on the
        device), from the graph of the batch's bucket (after `usable`)."""
        n = len(rows)
        if self.buffer() is not self._read:  # the buffer grew: graphs captured over the old one read freed memory
            self.graphs.clear()
            self._read = self.buffer()
        key = self.choice.choose((_bucket(n, self.batch_buckets), 0, gamma), self.graphs)
        pad = key[0] - n
        idx = torch.tensor(rows + [0] * pad, dtype=torch.long)  # host: copied into the graph's static input
        ids = torch.cat([anchors, anchors.new_zeros(pad)]) if pad else anchors
        if not self.capture:  # counted as a capture / replay would be, so the CPU tests see the policy
            if key not in self.graphs:
                self.graphs[key] = None
                self.captures += 1
            self.replays += 1
            drafts, conf = self.propose(idx.to(ids.device), ids, gamma)
            return drafts[:n], conf[:n]
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(key[0], gamma, ids.device)
                self.captures += 1
            except Exception:  # noqa: BLE001 - any capture failure means: propose eagerly from now on
                log.warning("CUDA graph capture of the drafter failed for batch %d; drafting eagerly", key[0],
                            exc_info=True)
                self.failed = True
                self.graphs.clear()
                drafts, conf = self.propose(idx.to(ids.device), ids, gamma)
                return drafts[:n], conf[:n]
        graph, static_idx, static_ids, drafts, conf = self.graphs[key]
        static_idx.copy_(idx)
        static_ids.copy_(ids)
        graph.replay()
        self.replays += 1
        return drafts[:n], conf[:n]

    def _capture(self, bucket: int, gamma: int, device: torch.device):
        idx = torch.zeros(bucket, dtype=torch.long, device=device)  # row 0: every buffer has one
        ids = torch.zeros(bucket, dtype=torch.long, device=device)
        graph, (drafts, conf) = capture_graph(lambda: self.propose(idx, ids, gamma))
        return graph, idx, ids, drafts, conf
