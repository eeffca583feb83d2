"""The ReplaySSM fold at padded shapes, by batch bucket, replayed from CUDA graphs.

The eager fold (`rollout.spec.replay.fold`) walks each committed token through every KDA layer, a few
dozen small ops per layer and token: on one H200 (2026-12-02, random k3-small, batch 1) that was 77 ms of
host time per verify step against 3 ms on the device (`scripts/profile_spec.py`). `FoldGraphs` folds
every row of a batch bucket over all `width` positions at once, layer by layer, in two parts:

- prepare: the block's short convs and gates, one call each for all positions (`block_kda_inputs`: the
  decode step's own per-element ops, so position j's values are what j decode steps compute), and the
  conv history (the state before the block, then the block's inputs);
- advance from `start` to `stop` per row: the recurrence over all `width` positions in one call
  (`miles_k3.ops.kda.kda_advance`: on CUDA the decode kernel over T = width tokens, reading each row's
  state in its slot once and writing it back, bit for bit what `width` decode steps write), each row's
  tokens outside start <= j < stop masked (decay 0 and beta 0 leave the recurrent state bit for bit), and
  the conv state at `stop` read off the history.

Layers are independent in the fold (each reads only its own raw inputs), so folding layer by layer instead
of token by token commits the same state. Padding rows sit on the sink slot with nothing to fold. The
2026-12-03 fold ran the convs and gates position by position (about 80 launches a layer, 1,900 a step
when it checkpoints): on one H200 at batch 1 (12-04) that was about 6 ms of a 7 ms speculative step's
device time, and its graph's launch costs host time by node.

Inputs are static buffers, one [bucket * width, C] per KDA layer and projection, row n's tokens at
n * width + j: a verify of `width` tokens per row (the graphed verify) fills them with one copy, a
planner's ragged verify with one index_copy.

Counts on the device: `fold` takes each row's committed count as a device tensor and never reads it, so the
fold is enqueued right behind the verify that decided it, and the host reads the step once, at its end
(`rollout.spec.strategy`). Chunk boundaries: a row that may reach a prefix-cache checkpoint position this step
(one within its verified tokens) must leave its state there in a checkpoint slot, and whether it reaches it is
not known yet. Such a step replays twice: prepare and advance up to min(boundary, count) per row, a copy of
every such row's working state (`checkpoint`), then advance the rest from the prepared block (a second graph:
the slot's conv state has moved, the block's history has not). The caller keeps the checkpoints of rows whose
count reached the boundary and frees the others, once it reads the counts. A row meets at most one boundary per
step (chunk_size >= width).

`capture=False` runs the same padded function eagerly: the CPU tests' way to check it against the eager
fold, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from miles_k3.ops.kda import PooledState, kda_advance
from rollout.forward import GraphChoice, _bucket, capture_graph
from rollout.spec.graphs import BATCH_BUCKETS
from rollout.spec.replay import PROJECTIONS, KDAInputs, block_kda_inputs, fold, kda_mixers, with_checkpoints
from rollout.transfer import to_device

log = logging.getLogger(__name__)


class FoldGraphs:
    """Folds of up to `width` tokens per row over the runner's current pools (drop it when they are rebuilt:
    graphs read the pools by address)."""

    def __init__(self, runner, width: int, capture: bool):
        self.runner, self.states, self.width, self.capture = runner, runner.states, width, capture
        self.mixers = kda_mixers(runner.model)
        max_batch = runner.config.max_running
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.graphs: dict[int, tuple] = {}  # bucket -> (prepare-and-advance graph, advance graph, static inputs)
        self.choice = GraphChoice()  # a larger captured bucket serves one asked for only a few times
        self.failed = False
        self.captures = self.replays = 0

    def fold(
        self,
        inputs: KDAInputs,
        slots: list[int],
        counts: torch.Tensor,
        positions: list[int],
        chunk_size: int,
        checkpoint: Callable[[list[int]], list[int | None]],
        exact: bool = False,
    ) -> list[tuple[int, int, int | None]]:
        """What `rollout.spec.replay.fold` does, through the bucket's graph, with counts [N] on the device
        (eagerly, reading the counts, past the largest bucket or after a failed capture). `exact`: the
        bucket's own graph, captured now if it is not yet (the start-up probes'), not a larger one.

        `checkpoint(rows)` copies those rows' working state into fresh slots (`CacheManager.snapshots`).
        Returns (row, boundary position, slot) for every checkpoint taken: a row's is its state at the
        boundary when the row committed up to it (positions[row] + counts[row] >= boundary), else the caller
        frees it."""
        n = len(slots)
        bucket = None if self.failed else _bucket(n, self.buckets)
        if bucket is not None and not exact:  # keys (bucket, 0): a fold has no history bucket
            bucket = self.choice.choose((bucket, 0), ((b, 0) for b in self.graphs))[0]
        static = None if bucket is None else self._static(bucket, inputs)
        if static is None:
            host = counts.tolist()
            return with_checkpoints(
                lambda at: fold(self.runner.model, self.states, inputs, slots, host, positions, chunk_size, at),
                host,
                positions,
                chunk_size,
                checkpoint,
            )
        self._load(static, inputs, slots, bucket)
        # tokens a row folds before its state may be checkpointed: up to the next chunk boundary
        cut = [chunk_size - p % chunk_size for p in positions]
        reach = [i for i in range(n) if cut[i] <= inputs.lengths[i]]
        if not reach:
            self._replay(static, None, counts, bucket)
            return []
        first = torch.minimum(counts, to_device(cut, counts.device))
        self._replay(static, None, first, bucket)
        snaps = checkpoint(reach)
        self._replay(static, first, counts, bucket)
        return [(i, positions[i] + cut[i], snap) for i, snap in zip(reach, snaps)]

    def _load(self, static: dict, inputs: KDAInputs, slots: list[int], bucket: int) -> None:
        n, w = len(slots), self.width
        device = static["slots"].device
        static["slots"].copy_(to_device(slots + [self.states.sink_slot] * (bucket - n), device))
        dense = all(k == w for k in inputs.lengths)
        dest = None if dense else to_device([i * w + j for i, k in enumerate(inputs.lengths) for j in range(k)], device)
        pairs = [(buf, inputs.layers[layer][p][0]) for layer, per in static["raw"].items() for p, buf in per.items()]
        if dense:  # every KDA layer's five projections in one multi-tensor copy, not a launch each
            torch._foreach_copy_([buf[: n * w] for buf, _ in pairs], [src for _, src in pairs])
        else:
            for buf, src in pairs:
                buf.index_copy_(0, dest, src)

    def _replay(self, static: dict, starts: torch.Tensor | None, stops: torch.Tensor, bucket: int) -> None:
        """Fold row n's tokens starts[n] <= j < stops[n]; starts None: from 0, preparing the block first (a
        fold's first replay), else from the block the first replay prepared. Padding rows fold nothing."""
        n = stops.shape[0]
        static["start"].zero_()
        if starts is not None:
            static["start"][:n].copy_(starts)
        static["stop"].zero_()
        static["stop"][:n].copy_(stops)
        whole, rest, _ = self.graphs[bucket]
        graph = whole if starts is None else rest
        if graph is None:
            self._step(static, prepare=starts is None)
        else:
            graph.replay()
        self.replays += 1

    def _static(self, bucket: int, inputs: KDAInputs) -> dict | None:
        """The bucket's static inputs (raw buffers shaped and typed as `inputs`' projections), capturing its
        graphs the first time; None when a capture fails."""
        if bucket in self.graphs:
            return self.graphs[bucket][2]
        device, w = self.runner.device, self.width
        raw = {
            layer: {
                p: inputs.layers[layer][p].new_zeros(bucket * w, inputs.layers[layer][p].shape[-1]) for p in PROJECTIONS
            }
            for layer in self.mixers
        }
        static = dict(
            raw=raw,
            slots=torch.full((bucket,), self.states.sink_slot, dtype=torch.long, device=device),
            start=torch.zeros(bucket, dtype=torch.long, device=device),
            stop=torch.zeros(bucket, dtype=torch.long, device=device),
            offsets=torch.arange(w, device=device),  # a block's positions
            window=torch.arange(next(iter(self.states.conv.values())).shape[-1], device=device),
        )
        self.captures += 1  # counted as on CUDA when the padded shape runs eagerly (the CPU tests' policy)
        if not self.capture:
            self.graphs[bucket] = (None, None, static)
            return static
        try:  # warm-ups and captures fold nothing: stop = 0 on the sink slot. The second graph reads the block
            # the first one's capture prepared (its output tensors, kept in `static`): a capture only records,
            # so the first graph is replayed once before the second one's warm-ups read that block (else they
            # would fold whatever that memory held into the sink slot: NaNs that padding rows read later)
            whole, _ = capture_graph(lambda: self._step(static, prepare=True))
            whole.replay()
            rest, _ = capture_graph(lambda: self._step(static, prepare=False))
        except Exception:  # noqa: BLE001 - any capture failure means: fold eagerly from now on
            log.warning("CUDA graph capture of the fold failed for batch %d; folding eagerly", bucket, exc_info=True)
            self.failed = True
            return None
        self.graphs[bucket] = (whole, rest, static)
        return static

    def _step(self, static: dict, prepare: bool) -> None:
        """The padded fold: every row, masked to start <= j < stop; `prepare` first computes the block's convs,
        gates and conv history (`block_kda_inputs`) into static["block"]."""
        slots, start, stop = static["slots"], static["start"], static["stop"]
        states, bucket, w = self.states, slots.shape[0], self.width
        with torch.inference_mode():
            if prepare:
                static["block"] = {}
                for layer, mixer in self.mixers.items():
                    raw = {p: buf.view(bucket, w, -1) for p, buf in static["raw"][layer].items()}
                    static["block"][layer] = block_kda_inputs(mixer, raw, states.conv[layer].index_select(0, slots))
            j = static["offsets"]
            active = (start[:, None] <= j) & (j < stop[:, None])  # [bucket, w]: the tokens each row folds
            at_stop = stop[:, None, None, None] + static["window"]  # the history entries of the conv state at stop
            for layer, ((q, k, v), g, beta, history) in static["block"].items():
                states.conv[layer].index_copy_(0, slots, history.gather(-1, at_stop.expand(*history.shape[:3], -1)))
                kda_advance(
                    q,
                    k,
                    v,
                    torch.where(active[..., None, None], g, 0.0),
                    torch.where(active[..., None], beta, 0.0),
                    PooledState(states.recurrent[layer], slots),
                    scratch=states.sink_slot,
                    use_qk_l2norm=True,
                )
