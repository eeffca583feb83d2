"""CUDA-graph drafting: a DSpark drafter's block proposal replayed from a graph, by batch bucket.

A block proposal is a few hundred small eager ops (two draft layers over the context windows, then per draft
position the Markov head, the confidence head and the draw): on the H200, 2026-12-04, 3.9 ms of host time a
step at batch 1, the largest part of a speculative step once the verify forward and the fold were graphs. A
batch whose rows are all greedy, or all sample without top-k / top-p, proposes from device tensors only: the
rows of the drafter's context buffer (`ContextWindows.read_rows`), the anchors, and for sampled rows their
temperatures, DRAFT-stream seeds and positions (`rollout.spec.verify.draw_scaled`). So it is captured once
per (batch bucket, gamma, greedy or sampled) and replayed with those copied into its static inputs. A batch
that mixes greedy and sampled rows, or truncates, proposes eagerly.

Padding: a batch is padded to its bucket with buffer row 0, token 0, temperature 1, seed and position 0; the
padded rows' drafts are computed and dropped. Graphs read the context buffer by address, so a buffer that grew
(`ContextWindows._grow`) drops them. A bucket is captured on its third ask and a larger captured graph serves
it until then (`rollout.forward.GraphChoice`, as the decode and verify graphs do). `capture=False` runs the
padded shapes eagerly: the CPU tests' way to check padding and bucketing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rollout.forward import GraphChoice, _bucket, capture_graph
from rollout.spec.graphs import BATCH_BUCKETS
from rollout.transfer import host_tensor

log = logging.getLogger(__name__)

# propose(idx [B], anchors [B], gamma, sampling: (temps [B], seeds [B], positions [B]) or None for greedy rows)
# -> (drafts [B, gamma], q [B, gamma, V] or None when greedy, confidences [B, gamma])
Propose = Callable[[torch.Tensor, torch.Tensor, int, tuple | None], tuple]


class DraftGraphs:
    """Block proposals over one context buffer (`buffer()` returns the tensor the graphs read; when it is
    another tensor, the graphs are dropped)."""

    def __init__(self, propose: Propose, buffer: Callable[[], torch.Tensor], max_batch: int, capture: bool):
        self.propose, self.buffer, self.capture = propose, buffer, capture
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        # (batch bucket, 0, gamma, sampled) -> (graph, static inputs, outputs); the 0 stands where the decode
        # graphs' keys hold a history bucket, so `GraphChoice` compares the keys the same way
        self.graphs: dict[tuple, tuple | None] = {}
        self.choice = GraphChoice()
        self._read: torch.Tensor | None = None  # the buffer the graphs were captured over
        self.failed = False
        self.captures = self.replays = 0

    def usable(self, n: int) -> bool:
        return not self.failed and _bucket(n, self.batch_buckets) is not None

    def run(
        self,
        rows: list[int],
        anchors: torch.Tensor,
        gamma: int,
        sampling: tuple[list[float], torch.Tensor, torch.Tensor] | None = None,
        exact: bool = False,
    ) -> tuple:
        """`propose`'s outputs for N rows (buffer rows `rows`, anchors [N] on the device; `sampling`: the rows'
        temperatures, DRAFT-stream seeds [N] and positions [N] on the device, None when every row is greedy),
        from the graph of the batch's bucket (after `usable`). `exact`: that bucket's own graph, captured now
        if it is not yet (the start-up probes'), not a larger one in its stead."""
        n = len(rows)
        if self.buffer() is not self._read:  # the buffer grew: graphs captured over the old one read freed memory
            self.graphs.clear()
            self._read = self.buffer()
        key = (_bucket(n, self.batch_buckets), 0, gamma, sampling is not None)
        if not exact:
            key = self.choice.choose(key, self.graphs)
        pad = key[0] - n
        inputs = [host_tensor(rows + [0] * pad, torch.long), _padded(anchors, pad, 0)]
        if sampling is not None:
            temps, seeds, at = sampling
            inputs += [host_tensor(temps + [1.0] * pad, torch.float32), _padded(seeds, pad, 0), _padded(at, pad, 0)]
        if not self.capture:  # counted as a capture / replay would be, so the CPU tests see the policy
            if key not in self.graphs:
                self.graphs[key] = None
                self.captures += 1
            self.replays += 1
            return _rows(self._call(inputs, anchors.device, gamma), n)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(inputs, anchors.device, gamma)
                self.captures += 1
            except Exception:  # noqa: BLE001 - any capture failure means: propose eagerly from now on
                log.warning(
                    "CUDA graph capture of the drafter failed for batch %d; drafting eagerly", key[0], exc_info=True
                )
                self.failed = True
                self.graphs.clear()
                return _rows(self._call(inputs, anchors.device, gamma), n)
        graph, static, out = self.graphs[key]
        for s, x in zip(static, inputs):
            s.copy_(x)
        graph.replay()
        self.replays += 1
        return _rows(out, n)

    def _call(self, inputs: list[torch.Tensor], device: torch.device, gamma: int) -> tuple:
        idx, ids, *sampling = (x.to(device) for x in inputs)
        return self.propose(idx, ids, gamma, tuple(sampling) or None)

    def _capture(self, inputs: list[torch.Tensor], device: torch.device, gamma: int):
        static = [torch.zeros_like(x, device=device) for x in inputs]  # row 0, token 0: every buffer has them
        if len(static) > 2:
            static[2].fill_(1.0)  # temperature 1 until the first replay's copy
        idx, ids, *sampling = static
        graph, out = capture_graph(lambda: self.propose(idx, ids, gamma, tuple(sampling) or None))
        return graph, static, out


def _padded(x: torch.Tensor, pad: int, value) -> torch.Tensor:
    return torch.cat([x, x.new_full((pad,), value)]) if pad else x


def _rows(out: tuple, n: int) -> tuple:
    return tuple(None if t is None else t[:n] for t in out)
