"""CUDA-graph verify: the verify forward of `SpecConfig.planner="verify_all"` at padded shapes, by batch bucket.

Under verify_all every row feeds the same `width` = gamma + 1 tokens (its anchor and gamma drafts), so a
verify step is an [N, width] batch, not a packed one: the shape a CUDA graph can hold, as the plain decode
step's graphs do (`rollout.forward.DecodeGraphs`; the same buckets, the same sink rows). A graph holds one
verify forward over `VerifyStateCache` (the committed KDA state is read, never written) with the KDA
projections and the drafter's taps read by forward hooks during the capture: the hooked outputs are
tensors of the graph's memory, refilled by every replay, so the fold reads them after a replay exactly
as it reads an eager step's.

Padding: a batch is padded to its bucket with rows on the pools' sink slot and sink page, the history to
a page-rounded power of two (the zero page beyond a row's end). A bucket gets its own graph once asked for
a few times; until then a larger captured one serves it (`rollout.forward.GraphChoice`, as the decode
graphs do): a rollout's batch shrinks through most buckets as its rows stop, and a capture of a batch-256
verify costs about three eager forwards (2026-12-03, one H200: recaptures inside a timed run were most of a
speculative step's time). A row close to its length limit still
feeds `width` tokens (verification stops at its limit, `rollout.spec.verify`): its page table is extended
with the sink page, so the tokens past its pages write only there, and positions inside its pages never
read them (attention is causal).

`capture=False` runs the same padded shapes eagerly: the CPU tests' way to check padding and bucketing.
Batches that mix adapters are not `usable` (the graph's key holds one adapter slot and its scale).
"""

from __future__ import annotations

import logging

import torch

from rollout.forward import GraphChoice, _bucket, capture_graph, hooks, model_step, tapped_rows
from rollout.spec.replay import PROJECTIONS, KDAInputs, VerifyStateCache, kda_mixers
from rollout.state_cache import BatchLayout

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class VerifyGraphs:
    """Verify forwards of `width` tokens per row over the runner's current pools (drop it when they are
    rebuilt: graphs read the pools by address). `taps`: extra modules whose outputs the step returns."""

    def __init__(self, runner, width: int, taps: dict[str, torch.nn.Module], capture: bool):
        self.runner, self.kv, self.states = runner, runner.kv, runner.states
        self.width, self.capture = width, capture
        self.watched = {f"{i}.{p}": getattr(m, p) for i, m in kda_mixers(runner.model).items() for p in PROJECTIONS}
        self.watched.update({f"tap.{k}": m for k, m in taps.items()})
        max_batch = runner.config.max_running
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        page = self.kv.page_size
        top = -(-(runner.config.max_seq_len + width) // page) * page
        self.hist_buckets = sorted({min(top, max(page, 1 << s)) for s in range(6, 40) if (1 << (s - 1)) < top})
        # (batch bucket, history bucket, *adapter key) -> (graph, ids, layout, logits, hooked outputs)
        self.graphs: dict[tuple, tuple] = {}
        self.choice = GraphChoice()
        self.failed = False
        self.captures = self.replays = 0

    def _slot_key(self, batch) -> tuple | None:
        """() without adapters; (slot, scale) when every row uses one adapter slot; None when they mix."""
        pool = self.runner.adapters
        if pool is None:
            return ()
        slots = {pool.slot_of(r.req.adapter) for r in batch}
        return (next(iter(slots)), float(pool.scale[next(iter(slots))])) if len(slots) == 1 else None

    def exact_key(self, batch) -> tuple | None:
        """The buckets of `batch` (None: run it eagerly)."""
        if self.failed or (slot_key := self._slot_key(batch)) is None:
            return None
        bb = _bucket(len(batch), self.batch_buckets)
        sb = _bucket(max(r.pos for r in batch) + self.width, self.hist_buckets)
        return None if bb is None or sb is None else (bb, sb, *slot_key)

    def key(self, batch) -> tuple | None:
        """The graph that serves a step of `batch`, counting the ask (`rollout.forward.GraphChoice`: a larger
        captured graph serves a bucket asked for fewer than `CAPTURE_AFTER` times); None: run it eagerly."""
        exact = self.exact_key(batch)
        return None if exact is None else self.choice.choose(exact, self.graphs)

    def run(self, key: tuple, batch, ids: torch.Tensor) -> tuple[torch.Tensor, KDAInputs, dict[str, torch.Tensor]]:
        """ids [N, width] (device) for `batch` -> what `rollout.spec.replay.verify_forward` returns for rows
        of `width` tokens each: logits [N * width, V], the KDA inputs, the taps' outputs ([1, N * width, ..])."""
        n, w = len(batch), self.width
        bb, sb = key[0], key[1]
        pad = bb - n
        kv, sink = self.kv, self.kv.sink_page
        tables = [r.pages + [sink] * max(0, -(-(r.pos + w) // kv.page_size) - len(r.pages)) for r in batch]
        target = torch.device("cpu") if self.capture else self.runner.device
        layout = BatchLayout.build(
            kv,
            [r.slot for r in batch] + [self.states.sink_slot] * pad,
            [r.pos for r in batch] + [0] * pad,
            [w] * bb,
            tables + [[sink] * -(-w // kv.page_size)] * pad,
            target,
            hist_len=sb,
            dcp_rank=self.runner.dcp_rank,
        )
        ids = torch.cat([ids, ids.new_zeros(pad, w)]) if pad else ids
        if self.runner.adapters is not None:  # sink rows take the batch's slot: same shapes, no mixing
            self.runner.adapters.set_batch([key[2]] * bb, w)
        if not self.capture:
            if key not in self.graphs:
                self.graphs[key] = None
                self.captures += 1
            self.replays += 1
            store: dict[str, torch.Tensor] = {}
            with hooks(self.watched, store):
                logits = self._step(ids, layout)
            return self._outputs(logits, store, n)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(bb, sb)
                self.captures += 1
            except Exception:  # noqa: BLE001 - any capture failure means: verify eagerly from now on
                log.warning(
                    "CUDA graph capture of the verify step failed for batch %d, history %d; verifying eagerly",
                    bb,
                    sb,
                    exc_info=True,
                )
                self.failed = True
                self.graphs.clear()
                store = {}
                with hooks(self.watched, store):
                    logits = self._step(ids, layout.to(self.runner.device))
                return self._outputs(logits, store, n)
        graph, static_ids, static_layout, logits, store = self.graphs[key]
        static_ids.copy_(ids)
        static_layout.copy_(layout)
        graph.replay()
        self.replays += 1
        return self._outputs(logits, store, n)

    def _step(self, ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        with torch.inference_mode():
            return model_step(
                self.runner.model, ids, VerifyStateCache(self.kv, self.states, layout), None, every_token=True
            )

    def _outputs(self, logits: torch.Tensor, store: dict, n: int):
        """The first n rows of a padded step, in the packed form the fold and the drafter read."""
        t = n * self.width
        inputs = KDAInputs([self.width] * n)
        tapped = {}
        for name, flat in tapped_rows(store, t).items():
            if name.startswith("tap."):
                tapped[name[4:]] = flat
            else:
                layer, proj = name.split(".")
                inputs.layers.setdefault(int(layer), {})[proj] = flat
        return logits[:t], inputs, tapped

    def _capture(self, bb: int, sb: int):
        # warm-up and capture on sink-only rows: they touch no request's state or KV
        kv, w, device = self.kv, self.width, self.runner.device
        layout = BatchLayout.build(
            kv,
            [self.states.sink_slot] * bb,
            [0] * bb,
            [w] * bb,
            [[kv.sink_page] * -(-w // kv.page_size)] * bb,
            device,
            hist_len=sb,
            dcp_rank=self.runner.dcp_rank,
        )
        ids = torch.zeros(bb, w, dtype=torch.long, device=device)
        store: dict[str, torch.Tensor] = {}  # the hooked projections' outputs inside the graph's memory
        graph, logits = capture_graph(lambda: self._step(ids, layout), lambda: hooks(self.watched, store))
        return graph, ids, layout, logits, store
