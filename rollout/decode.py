"""The decode pipeline: decode steps enqueued on the device and read back, with the overlap schedule.

Overlap (`EngineConfig.overlap`, on by default on CUDA): a decode step is enqueued with its sampled tokens
left on the device, and the next engine step enqueues the following decode of the same requests, fed from
those device tokens, before the host reads the first step's tokens. So the host's bookkeeping for step k
(token appends, stop checks, radix-tree inserts) and its preparation of step k+1 (pages, layout, graph
inputs) run while the device computes. The price: a request that stops on a stop token has already been
fed into one more step, whose row is discarded (its pages and slot are freed after that step in stream
order). A request's length limit is known in advance, so it is not fed past it (`Scheduler.continue_decode`).
Outputs are those of the plain schedule: every request's draw is a function of its seed and the drawn
token's position (`rollout.noise`) either way.

What a step computes per row is the `DecodeStrategy`'s: the pipeline decides when steps are enqueued and
read, and does the radix-cache handovers around them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rollout.cache_manager import CacheManager, Running
from rollout.model_runner import ModelRunner
from rollout.sampler import hand_alternatives, sample_alternatives
from rollout.scheduler import Scheduler
from rollout.transfer import to_device, to_host


@dataclass(eq=False)
class DecodeLaunch:
    """A decode step whose forward and sampling are enqueued; its tokens may not be on the host yet.

    `batch[n]` was fed its input and its `pos` advanced. `tokens` [N] (device) are the samples, the next
    step's input; `host` [2, N] float64 receives tokens and log-probs (pinned, filled asynchronously on
    CUDA; `ready` marks the copy). `snapshots` holds (request, position, checkpoint slot or None) for rows
    that reached a chunk boundary: the state was copied when the step was enqueued, the tree insert waits
    for the tokens. `overlaps`: whether the next step may be enqueued before this one is read (it advanced
    every row's `pos` by one and its `tokens` feed the next step); a step that is not is read at once."""

    batch: list[Running]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    snapshots: list[tuple[Running, int, int | None]] = field(default_factory=list)
    overlaps: bool = True
    # host copy of the asking rows' alternatives (`rollout.sampler.alternatives` rows; a verify step's: one per
    # verified position, `block_alternatives`), read into their requests' `step_alternatives` by `read`
    alternatives: torch.Tensor | None = None


class DecodeStrategy:
    """What one decode step computes for each row: the seam for decodes other than one token per row.

    `OneToken` is the engine's; speculative decoding (`rollout.spec.strategy.SpecDecode`: draft gamma tokens,
    verify gamma + 1 in one forward, keep a prefix, fold the KDA state over it) is the other. The pipeline
    calls `use_memory` once, then `launch` once per step, with `batch` the scheduler's decode rows, each
    row's pages already covering [0, r.pos + lookahead), and later calls `read` on what `launch` returned:
    at once without overlap, one engine step later with it.

    What a strategy may touch, and when:
    - pools: through `ModelRunner.forward` (or, for a step that must not commit its KDA state, a forward
      over a cache of its own, `rollout.spec.replay`), writing each row's KV at positions [r.pos, r.pos +
      lookahead) of its own pages and its working KDA slot. A strategy that must undo state takes slots
      from and gives them back to the cache manager (`snapshots`, `free_snapshot`) within its own launch /
      read; rejected KV rows need nothing (they lie past the row's pos and are rewritten before anything
      reads them).
    - radix cache: never directly. Locks, inserts and checkpoints are the pipeline's: after `launch` it
      snapshots every row whose new `pos` is a chunk boundary, and after `read` it inserts the launch's
      `snapshots`. A row that advances several tokens can cross a boundary inside its step: the strategy
      takes that snapshot itself (`CacheManager.snapshots`, when its working slot holds the state at the
      boundary) and lists it in `launch.snapshots` as (row, boundary position, slot) by the end of `read`.
      A strategy with `own_checkpoints` takes every boundary's snapshot of its step itself, the step's
      end included, and the pipeline takes none.
    - sampler: draws with the row's own noise, so a request's outputs do not depend on the batch or the
      schedule: `rollout.noise` keyed by (r.req.seed or one of its streams, the drawn token's position).
    - alternatives: for every row whose params ask (`SamplingParams.alternatives`), `read` sets its request's
      `step_alternatives`, one entry per token it returns for the row, from the logits that token's log-prob
      was read from (`rollout.sampler.hand_alternatives`); the engine's `_append` takes them.
    - a launch with `overlaps` (`DecodeLaunch.overlaps`) enqueues and must not wait for the device (no
      `.item()`, `.tolist()`, blocking copies): the overlap schedule relies on it; it advances each row's
      `pos` by one. A launch without `overlaps` may wait (a verify step's accepted lengths decide its
      fold), best in `read`, and `read` advances `pos` past the positions the row committed (the pipeline
      reads such a step right after launching it): the new `pos` never exceeds the row's token count after
      `read`'s tokens are appended (tokens past a stop token or the length limit are neither returned nor
      committed).
    - `ids` is each row's next input token: a host list, or with overlap the previous launch's device
      `tokens` (rows selected). `continues(batch)` is asked before a step is launched that way (the host
      has not read the previous one): a strategy whose next step would advance rows by more than one
      token, or needs their tokens on the host, says False, and the pipeline reads first.
    """

    lookahead = 1  # KV positions past r.pos one step may write per row
    own_checkpoints = False  # whether the strategy snapshots every chunk boundary of its step (see above)

    def continues(self, batch: list[Running]) -> bool:
        """Whether the next step of `batch` may be launched before the previous step is read (its launch
        then has `overlaps`)."""
        return True

    def use_memory(self, memory: CacheManager) -> None:
        """The cache manager whose `snapshots` / `free_snapshot` the strategy may call (see above)."""

    def prefill(
        self, forward: Callable[[], torch.Tensor], batch: list[Running], spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Run one of the engine's packed prefill forwards (`forward()` returns its logits) over `batch`, row
        n computing positions spans[n] = (start, end): a strategy that keeps per-request state from the
        target's activations (a drafter's context) reads them here. The plain strategy just runs it."""
        return forward()

    def launch(self, batch: list[Running], ids: list[int] | torch.Tensor) -> DecodeLaunch:
        raise NotImplementedError

    def read(self, launch: DecodeLaunch) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's new tokens and their log-probs, in order."""
        raise NotImplementedError


class OneToken(DecodeStrategy):
    """One forward, one sampled token per row. Rows whose params ask for alternatives (top log-probs, given
    ids' log-probs) get them from the step's own logits and log-softmax (`rollout.sampler.sample_alternatives`;
    on CUDA such a batch samples through the torch path), read back with the tokens and handed to each row's
    request (`Request.step_alternatives`); a batch where no row asks samples as it always did."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def launch(self, batch: list[Running], ids: list[int] | torch.Tensor) -> DecodeLaunch:
        logits = self.runner.forward(batch, ids, [1] * len(batch))
        tokens, logps, alt = sample_rows(logits, batch, [r.pos + 1 for r in batch])  # the new token's position
        host, ready = to_host(torch.stack([tokens.to(torch.float64), logps.to(torch.float64)]))
        alternatives, ready = copy_alternatives(alt, ready)
        for r in batch:
            r.pos += 1
        return DecodeLaunch(batch, tokens, host, ready, alternatives=alternatives)

    def read(self, launch: DecodeLaunch) -> tuple[list[list[int]], list[list[float]]]:
        if launch.ready is not None:
            launch.ready.synchronize()
        tokens, logps = launch.host.tolist()
        if launch.alternatives is not None:
            hand_alternatives(
                [r.req for r in launch.batch], launch.alternatives.tolist(), self.runner.model.config.vocab_size
            )
        return [[int(t)] for t in tokens], [[lp] for lp in logps]


def sample_rows(
    logits: torch.Tensor, batch: list[Running], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One token a row from logits [N, V]: row n's request's draw of the token at positions[n] (its seed's noise
    there), that token's log-prob, and the alternatives of the rows that ask (`sample_alternatives`: None when
    none asks, and then the batch samples as `sample_on_device` does). Device tensors, nothing waited for."""
    keys = to_device([[r.req.seed for r in batch], positions], logits.device, torch.long)
    return sample_alternatives(logits, [r.req.params for r in batch], keys)


def copy_alternatives(
    alternatives: torch.Tensor | None, ready: torch.cuda.Event | None
) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
    """A step's alternatives (None: no row asked) copied to the host after the step's other copies, whose event
    is `ready`: (the host copy or None, the event that now marks every copy, recorded after this one)."""
    if alternatives is None:
        return None, ready
    return to_host(alternatives)


class DecodePipeline:
    """Runs decode steps through a strategy; with `overlap`, keeps one step in flight across engine steps.

    `on_tokens(batch, tokens, logps)` receives each read-back step's rows still running, with their new
    tokens (the engine appends them and finishes requests)."""

    def __init__(
        self,
        strategy: DecodeStrategy,
        scheduler: Scheduler,
        memory: CacheManager,
        on_tokens: Callable[[list[Running], list[list[int]], list[list[float]]], None],
        overlap: bool,
    ):
        self.strategy, self.scheduler, self.memory, self.on_tokens = strategy, scheduler, memory, on_tokens
        strategy.use_memory(memory)
        self.overlap = overlap
        self.inflight: DecodeLaunch | None = None  # the enqueued step not yet read back (overlap)

    def run(self, batch: list[Running]) -> None:
        """Decode `batch` (the scheduler's plan) one step."""
        if not batch:
            return
        launch = self._launch(batch, [r.tokens[r.pos] for r in batch])
        if self.overlap and launch.overlaps:
            self.inflight = launch
        else:
            self.resolve(launch)

    def advance(self) -> bool:
        """With a step in flight: enqueue the next decode of its requests when the scheduler can plan it
        without their tokens, then read the earlier step back. True when a step is in flight again (this
        engine step's forward is done); False when the engine should schedule instead."""
        if (prev := self.inflight) is None:
            return False
        self.inflight = self._continue(prev)  # enqueued before prev's tokens are read
        self.resolve(prev)
        if self.inflight is None:
            return False
        self.settle()
        return True

    def _launch(self, batch: list[Running], ids: list[int] | torch.Tensor) -> DecodeLaunch:
        """Enqueue a step, then snapshot the working state of rows reaching a chunk boundary now, before a
        later step overwrites it (after the strategy's own snapshots of boundaries crossed inside the step)."""
        launch = self.strategy.launch(batch, ids)
        if not self.strategy.own_checkpoints:
            chunk = self.memory.config.chunk_size
            rows = [r for r in batch if r.pos % chunk == 0]
            launch.snapshots += [(r, r.pos, snap) for r, snap in zip(rows, self.memory.snapshots(rows))]
        return launch

    def _continue(self, prev: DecodeLaunch) -> DecodeLaunch | None:
        keep = self.scheduler.continue_decode(prev.batch)
        if keep is None or not self.strategy.continues([prev.batch[i] for i in keep]):
            return None
        ids = prev.tokens if len(keep) == len(prev.batch) else prev.tokens[to_device(keep, prev.tokens.device)]
        launch = self._launch([prev.batch[i] for i in keep], ids)
        assert launch.overlaps, "a strategy's continues() said yes to a launch that must be read at once"
        return launch

    def resolve(self, launch: DecodeLaunch) -> None:
        """Read a launched step's tokens back: tree inserts for its snapshots, then the tokens. Rows of
        requests that left meanwhile (stopped a step earlier, aborted) are discarded. A snapshot past the
        row's known tokens (a multi-token step's) is inserted once its tokens are appended, if the row is
        still running then."""
        tokens, logps = self.strategy.read(launch)
        running = set(self.scheduler.running)
        later = []
        for r, pos, snap in launch.snapshots:
            if r not in running:
                self.memory.free_snapshot(snap)
            elif pos <= len(r.tokens):
                self.memory.donate_at(r, pos, snap)
            else:
                later.append((r, pos, snap))
        live = [i for i, r in enumerate(launch.batch) if r in running]
        self.on_tokens([launch.batch[i] for i in live], [tokens[i] for i in live], [logps[i] for i in live])
        running = set(self.scheduler.running)
        for r, pos, snap in later:
            if r in running:
                self.memory.donate_at(r, pos, snap)
            else:
                self.memory.free_snapshot(snap)

    def settle(self) -> None:
        """Read back an enqueued step none of whose requests is still running (they stopped or were
        aborted): nothing would read it otherwise, and its snapshot slots must return to the pool."""
        if self.inflight is not None and not any(r in self.scheduler.running for r in self.inflight.batch):
            launch, self.inflight = self.inflight, None
            self.resolve(launch)

    def pending_slots(self) -> set[int]:
        """Snapshot slots of the in-flight step, whose tree inserts wait for its tokens."""
        if self.inflight is None:
            return set()
        return {snap for _, _, snap in self.inflight.snapshots if snap is not None}
