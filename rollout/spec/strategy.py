"""Speculative decoding as a decode strategy: draft a block, verify it in one target forward, keep a prefix.

Per step and row: the drafter proposes gamma tokens after the anchor (the row's next input token); the
planner (`SpecConfig.planner`) picks how many of them to verify (all, or the cost-aware planner's prefix,
or none: the planner's plain step, one token a row without drafting, where no block pays at this batch),
never past the row's length limit; one packed target forward feeds the anchor and those drafts
(`rollout.spec.replay.verify_forward`, which leaves the committed KDA state untouched);
`rollout.spec.verify.verify` keeps the surviving drafts and draws the token after them; the emitted
tokens are cut at a stop token or the length limit; the KDA state is then folded forward over the
committed tokens only (ReplaySSM, `rollout.spec.replay.fold`), with a prefix-cache checkpoint wherever
the fold crosses a chunk boundary. With `SpecConfig.rollback="snapshot"` (the baseline) the state is
instead advanced over every verified token with a snapshot per draft step, and the accepted length's
snapshot kept (`rollout.spec.snapshot`): the same committed state. The row's `pos` advances by the tokens
committed (1..gamma + 1) and the last emitted token is its next anchor.

On a sharded engine (`rollout.parallel`: TP, DCP, EP) every rank runs this strategy on the same inputs, as
it runs the rest of the engine: the drafter is replicated (its lm_head logits all-gathered from the
vocab-parallel shards), the verify forward and the fold work on the rank's own KDA heads and KV rows, the
verify logits arrive all-gathered, and the cost-aware planner uses the leader's measured surface, so every
rank accepts the same tokens without sending them.

The step's phases run under `torch.profiler.record_function` labels (`spec.propose`, `spec.verify_forward`,
`spec.verify`, `spec.sync`, `spec.fold`, `spec.observe`): `scripts/profile_spec.py` reads them.

Alternatives (`SamplingParams.top_logprobs` / `token_ids_logprob`): a verify step reads the asking rows' from
its logits at every verified position (`rollout.sampler.block_alternatives`, the distribution the emitted
tokens' log-probs come from: the target's at the request's temperature, untruncated), copies them with the
step's read and hands each row those of the tokens it commits; a plain step's come with its sample, as
`OneToken`'s. Prompt log-probs come from the engine's prefill, which speculation only taps. The emitted tokens
and their log-probs are the same whether a row asks or not.

MLA rows written for rejected drafts lie past `pos` and are rewritten by the next step before anything
reads them.

One read per step, at its end: `launch` enqueues draft, verify, the counts each row commits (cut at its
stop tokens and length on the device, `_committed`), their copy to the host and the graphed fold, which
takes those counts on the device; the host reaches `read` while the device still runs the verify forward,
and only `read` waits. The fold cannot call back at a chunk boundary it does not know it reaches, so it
checkpoints every row that may reach one this step and `read` keeps the checkpoints of the rows that did
(`own_checkpoints`: the end-of-step boundary too). The eager fold and the snapshot baseline read the counts
in `launch`. The next step needs a verify step's counts (its positions, pages and anchors), so a verify step
is read before the next is launched. A plain step (one token a row) overlaps as plain decoding does: it
advances `pos` at launch, and while the next step would be plain too (`continues`: over `max_batch`, or the
planner's choice, which reads nothing a plain step changes) the pipeline launches it before reading this one.

CUDA graphs: on CUDA (where the decode graphs apply) the verify forward replays a graph of an [N, w]
block by batch bucket and width (`rollout.spec.graphs`): w = gamma + 1 under verify_all, w = the planner's
width under the cost-aware planner (it plans by width there: every row verifies w - 1 drafts, which the
graph computes anyway; its cost surface is measured on these graphs; rows near their length limit verify
fewer), and the fold replays a graph by batch bucket (`rollout.spec.fold_graphs`). Batches that mix adapters
and the CPU run the packed eager forward. Verification, and the alternatives, run eagerly on the verify
forward's logits either way (a graph's are its static output, read before the next replay in stream order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from rollout.cache_manager import CacheManager, Running
from rollout.decode import DecodeLaunch, DecodeStrategy, copy_alternatives, sample_rows
from rollout.forward import hooks
from rollout.model_runner import ModelRunner
from rollout.sampler import block_alternatives, hand_alternatives
from rollout.spec.config import SpecConfig
from rollout.spec.fold_graphs import FoldGraphs
from rollout.spec.graphs import BATCH_BUCKETS, VerifyGraphs
from rollout.spec.planner import CostSurface, VerifyPlanner
from rollout.spec.replay import fold, verify_forward, with_checkpoints
from rollout.spec.snapshot import SnapshotWindow
from rollout.spec.verify import verify
from rollout.transfer import to_device, to_host


@dataclass
class SpecStats:
    """Counted since the strategy was built: verify steps (and plain ones), rows verified,
    drafts verified, drafts kept,
    tokens emitted (kept drafts plus one per row, before a stop cut), the most draft-window bytes per row
    a step needed (ReplaySSM: its KDA inputs; the snapshot baseline: its gamma state snapshots), and the
    steps whose verify forward and whose fold replayed a captured CUDA graph (the rest ran eagerly, the CPU's
    padded shapes included), and the graphs the steps captured (verify, fold and the drafter's; a capture
    costs about three eager forwards): a benchmark's way to tell a slow step from an eager or a capturing one.
    `plain_seconds` / `verify_seconds`: the steps' own times as the planner reads them (from launch, or from
    the previous read for a step launched before it, to read; the `untimed` steps that captured a graph, and
    their `untimed_seconds`, apart): against the run's wall time, the host's work between steps that no
    step's price carries."""

    steps: int = 0
    plain_steps: int = 0  # one token a row, no drafts: a batch over `SpecConfig.max_batch`, or the planner's choice
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    window_bytes: int = 0
    verify_graphed: int = 0
    fold_graphed: int = 0
    captures: int = 0
    plain_seconds: float = 0.0
    verify_seconds: float = 0.0
    untimed: int = 0
    untimed_seconds: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens a row advances per verify step (accepted drafts + 1)."""
        return self.emitted / max(self.rows, 1)


@dataclass(eq=False)
class SpecLaunch(DecodeLaunch):
    """A verify step enqueued: `tokens` [N, w] and `host` [N, 2w + 2] (tokens, their log-probs, the count each
    row commits, the count it emitted before the stop cut; filled asynchronously on CUDA, `ready` marks the
    copy), the boundary checkpoints the fold took before the counts were known (row, position, slot), and
    what `read` completes the step with."""

    checkpoints: list[tuple[int, int, int | None]] = field(default_factory=list)
    tapped: dict[str, torch.Tensor] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)  # tokens each row fed the verify forward
    starts: list[int] = field(default_factory=list)  # a verify step's rows' pos at launch (their first fed position)
    plain: bool = False  # a plain step (one token a row: above `SpecConfig.max_batch`, or the planner's choice)
    started: float = 0.0  # perf_counter at launch: the planner prices the step's cell with launch-to-read
    captured: int = 0  # graphs captured before the step (a step that captured one is not a price)


class SpecDecode(DecodeStrategy):
    own_checkpoints = True

    def __init__(
        self, runner: ModelRunner, spec: SpecConfig, graphs: bool | None = None, surface: CostSurface | None = None
    ):
        """`graphs`: verify and fold through CUDA graphs (`rollout.spec.graphs`, `rollout.spec.fold_graphs`);
        None: where the runner's decode graphs apply (CUDA), eager otherwise. On CPU True runs their padded
        shapes eagerly. The cost-aware planner's surface is then measured on the graphed forward it runs;
        `surface` plans on a given one instead (measured elsewhere, or a known staircase in a test)."""
        self.runner, self.gamma, self.rollback, self.max_batch = runner, spec.gamma, spec.rollback, spec.max_batch
        if graphs is None:
            graphs = runner.graphs_apply()
        self.graph_verify = graphs
        self._verify_graphs: dict[int, VerifyGraphs] = {}  # by width, over the pools they were built on
        self._fold_graphs: FoldGraphs | None = None  # over the pools it was built on
        self._snapshots: SnapshotWindow | None = None  # rollback="snapshot": over the pools it was built on
        self.lookahead = spec.gamma + 1
        self.drafter = spec.build_drafter(runner)
        self.memory: CacheManager | None = None
        self.stats = SpecStats()
        self.unread = 0  # plain steps launched and not yet read (the pipeline's overlap)
        self._last_read = 0.0  # perf_counter when the last step's read ended
        self.planner = None
        if spec.planner == "cost_aware":  # steps price a measured surface, on one process (planner docstring)
            learn = surface is None and runner.model.model.tp.size == 1
            self.planner = VerifyPlanner(surface or self._measure_surface(), by_width=graphs, learn=learn)

    def use_memory(self, memory: CacheManager) -> None:
        self.memory = memory

    def continues(self, batch: list[Running]) -> bool:
        """Only into a plain step: over `max_batch`, or where the planner would allot no drafts (its choice
        reads the lagged survivals and the surface, which a plain step leaves as they are until it is read)."""
        if self.max_batch is not None and len(batch) > self.max_batch:
            return True
        if self.planner is None:
            return False
        return self.planner.choose([r.req.request_id for r in batch], self.gamma) == 0

    def prefill(self, forward, batch, spans):
        """The prefill forward with the drafter's taps read, handed to `Drafter.prefilled` (its contexts from
        the engine's own prefill rather than a pass of their own)."""
        if not self.drafter.taps:
            return forward()
        tapped: dict[str, torch.Tensor] = {}
        with hooks(self.drafter.taps, tapped):
            logits = forward()
        self.drafter.prefilled(batch, spans, tapped)
        return logits

    def launch(self, batch: list[Running], ids: list[int] | torch.Tensor) -> SpecLaunch:
        """Enqueue the step: draft, verify, the counts each row commits, their copy to the host, the fold.
        Nothing here waits for the device when verify and fold are graphed; `read` does, once."""
        n, g = len(batch), self.gamma
        started, captured = time.perf_counter(), self._captured()
        anchors = ids.reshape(-1) if torch.is_tensor(ids) else to_device(ids, self.runner.device)
        if self.max_batch is not None and n > self.max_batch:
            return self._plain(batch, anchors, started, captured)
        rids = [r.req.request_id for r in batch]
        allotted = g if self.planner is None else self.planner.allot(rids, g)  # from the previous step only
        if allotted == 0:  # no drafts pay for themselves at this batch: one token a row
            return self._plain(batch, anchors, started, captured)
        if self.unread:  # a verify step needs every row's tokens and positions on the host
            raise RuntimeError("SpecDecode: a verify step launched before the plain step in flight was read")
        params, seeds, positions = [r.req.params for r in batch], [r.req.seed for r in batch], [r.pos for r in batch]
        with record_function("spec.propose"):
            drafter_captures = self.drafter.captures
            drafts, q, *conf = self.drafter.propose(batch, anchors, g, params)
            self.stats.captures += self.drafter.captures - drafter_captures
            num = [g] * n if self.planner is None else self.planner.plan(rids, conf[0], allotted)
        # a row emits at most its remaining tokens, so it verifies no drafts past its length limit
        num = [min(k, r.req.params.max_new_tokens - len(r.req.output_ids) - 1) for k, r in zip(num, batch)]
        with record_function("spec.verify_forward"):
            logits, inputs, tapped = self._verify_forward(batch, torch.cat([anchors[:, None], drafts], dim=1), num)
        window = self._window() if self.rollback == "snapshot" else None
        if window is not None:  # the baseline: every verified step's state, before acceptance is known
            window.record(self.runner.model, self.runner.states, inputs, [r.slot for r in batch])
        w = logits.shape[1]  # a graph of width max(num) + 1 verifies only that many positions
        with record_function("spec.verify"):
            q = None if q is None else q[:, : w - 1]  # None: every row greedy
            tokens, logps, counts = verify(
                logits, drafts[:, : w - 1], q, params, seeds, to_device(positions, logits.device), num
            )
            committed = _committed(batch, tokens, counts)
        both = [tokens.double(), logps.double(), committed.double()[:, None], counts.double()[:, None]]
        host, ready = to_host(torch.cat(both, dim=1))  # the step's one read, waited for in `read`
        # the asking rows' alternatives at every verified position, from the logits their tokens' log-probs are
        # read from (outside any graph: the verify graph's logits are an output), copied with the step's read
        alternatives, ready = copy_alternatives(block_alternatives(logits, params), ready)
        slots, chunk = [r.slot for r in batch], self.memory.config.chunk_size

        def checkpoint(rows: list[int]) -> list[int | None]:
            return self.memory.snapshots([batch[i] for i in rows])

        with record_function("spec.fold"):
            if self.graph_verify and window is None:
                folds = self._folds()
                replays, captures = folds.replays, folds.captures
                taken = folds.fold(inputs, slots, committed, positions, chunk, checkpoint)
                self.stats.fold_graphed += folds.capture and folds.replays > replays
                self.stats.captures += folds.captures - captures
            else:  # the eager fold and the snapshot baseline read their counts here
                counts_h = committed.tolist()
                if window is not None:

                    def run(at):
                        window.commit(self.runner.states, slots, inputs.lengths, counts_h, positions, chunk, at)
                else:

                    def run(at):
                        fold(self.runner.model, self.runner.states, inputs, slots, counts_h, positions, chunk, at)

                taken = with_checkpoints(run, counts_h, positions, chunk, checkpoint)
        self.stats.window_bytes = max(
            self.stats.window_bytes, inputs.nbytes() // n if window is None else window.nbytes_per_row
        )
        self.stats.drafted += sum(num)
        return SpecLaunch(
            batch,
            tokens,
            host,
            ready,
            [],
            overlaps=False,
            checkpoints=taken,
            tapped=tapped,
            lengths=inputs.lengths,
            starts=positions,
            started=started,
            captured=captured,
            alternatives=alternatives,
        )

    def read(self, launch: SpecLaunch) -> tuple[list[list[int]], list[list[float]]]:
        """Wait for the step's copy, then complete it on the host: each row's committed tokens and log-probs,
        its checkpoints kept or freed, the drafter's view, `pos`, the counters."""
        with record_function("spec.sync"):
            if launch.ready is not None:
                launch.ready.synchronize()
        w = launch.tokens.shape[1]
        out_t, out_l, committed, emitted = [], [], [], 0
        if launch.plain:  # one token a row: two columns read whole (a plain step's host time is the step's at 256)
            out_t = [[t] for t in launch.host[:, 0].long().tolist()]
            out_l = [[lp] for lp in launch.host[:, 1].tolist()]
            committed, emitted = [1] * len(out_t), len(out_t)
        else:
            for row in launch.host.tolist():
                c = int(row[2 * w])
                out_t.append([int(t) for t in row[:c]])
                out_l.append(row[w : w + c])
                committed.append(c)
                emitted += int(row[2 * w + 1])
        if launch.alternatives is not None:  # each asking row's first `committed` of its w positions (plain: 1 of 1)
            requests, vocab = [r.req for r in launch.batch], self.runner.model.config.vocab_size
            hand_alternatives(requests, launch.alternatives.tolist(), vocab, committed, width=w)
        for i, pos, snap in launch.checkpoints:  # the rows' pos still stand before the step here
            if pos <= launch.batch[i].pos + committed[i]:
                launch.snapshots.append((launch.batch[i], pos, snap))
            else:
                self.memory.free_snapshot(snap)
        if launch.plain:
            self.unread -= 1  # its rows' pos advanced, and the drafter saw its taps, at launch
        else:
            with record_function("spec.observe"):
                self.drafter.observe(launch.batch, launch.tapped, launch.lengths, committed, launch.starts)
            for r, c in zip(launch.batch, committed):
                r.pos += c
        # from its launch, or from the last read when it was launched before that (an overlapped plain step:
        # its launch-to-read spans the next step's launch too), to its read: the step's share of the time
        now = time.perf_counter()
        seconds, s = now - max(launch.started, self._last_read), self.stats
        self._last_read = now
        if self._captured() != launch.captured:
            s.untimed, s.untimed_seconds = s.untimed + 1, s.untimed_seconds + seconds
        else:
            if launch.plain:
                s.plain_seconds += seconds
            else:
                s.verify_seconds += seconds
            if self.planner is not None:
                per = launch.tokens.shape[1] if self.planner.by_width else launch.lengths
                self.planner.observe(len(launch.batch), per, seconds)
        if launch.plain:
            s.plain_steps += 1
        else:
            s.steps, s.rows = s.steps + 1, s.rows + len(committed)
            s.accepted += emitted - len(committed)
            s.emitted += emitted
        return out_t, out_l

    def _plain(self, batch: list[Running], anchors: torch.Tensor, started: float, captured: int) -> SpecLaunch:
        """One token a row, as plain decoding samples it (`OneToken`), in the form `read` completes: the
        drafter's taps read at each row's token and handed to its `observe_plain` here (so its context stays
        current for the steps that speculate again), a row reaching a chunk boundary
        checkpointed, every row's `pos` advanced here, so the next plain step may be launched before this one
        is read. The taps are observed at launch, not at read: from a decode graph they are its static
        outputs, which the next plain step's replay refills, and under overlap that replay is enqueued before
        this step is read (the drafter would read the next position's states as this one's)."""
        n = len(batch)
        starts = [r.pos for r in batch]
        logits, tapped = self.runner.forward_tapped(batch, anchors, self.drafter.taps)
        tokens, logps, alt = sample_rows(logits, batch, [p + 1 for p in starts])
        ones = torch.ones(n, 2, dtype=torch.float64, device=tokens.device)  # committed and emitted: one token
        host, ready = to_host(torch.cat([tokens.double()[:, None], logps.double()[:, None], ones], dim=1))
        alternatives, ready = copy_alternatives(alt, ready)
        chunk = self.memory.config.chunk_size
        for r in batch:
            r.pos += 1
        ends = [r for r in batch if r.pos % chunk == 0]  # reached for sure: the pipeline's inserts
        snaps = [(r, r.pos, snap) for r, snap in zip(ends, self.memory.snapshots(ends))]
        with record_function("spec.observe"):
            self.drafter.observe_plain(batch, tapped, starts)
        self.unread += 1
        return SpecLaunch(
            batch,
            tokens[:, None],
            host,
            ready,
            snaps,
            alternatives=alternatives,
            lengths=[1] * n,
            plain=True,
            started=started,
            captured=captured,
        )

    def _captured(self) -> int:
        """Graphs captured so far: the steps' (verify, fold, the drafter's) and the decode graphs' (plain steps)."""
        return self.stats.captures + self.runner.graph_counts()[0]

    def _verify_forward(self, batch: list[Running], block: torch.Tensor, num: list[int]):
        """The verify forward of each row's anchor and its first num[n] drafts (block [N, g + 1]): logits
        [N, w, V] for w positions when graphed (w = g + 1 under verify_all, max(num) + 1 under the planner),
        [N, g + 1, V] eagerly (unverified
        positions zero or their own), the KDA inputs, the taps' outputs. From a CUDA graph of width w
        (`rollout.spec.graphs`: every row feeds w tokens, the planner's shorter rows verify only theirs) when
        one serves the batch, else one packed eager forward of the verified tokens only."""
        n, g1 = block.shape
        # verify_all keeps one width (rows near their limit feed the whole block): one graph per bucket
        width = g1 if self.planner is None else max(num, default=0) + 1
        graphs = self._graphs(width)
        key = graphs.key(batch) if graphs is not None else None
        if key is not None:
            replays, captures = graphs.replays, graphs.captures
            logits, inputs, tapped = graphs.run(key, batch, block[:, :width].contiguous())
            self.stats.verify_graphed += graphs.capture and graphs.replays > replays
            self.stats.captures += graphs.captures - captures
            return logits.view(n, width, -1), inputs, tapped
        lengths = [k + 1 for k in num]
        ragged = any(k < g1 for k in lengths)
        feed = torch.cat([block[i, :k] for i, k in enumerate(lengths)]) if ragged else block.flatten()
        logits, inputs, tapped = verify_forward(self.runner, batch, feed, lengths, self.drafter.taps)
        if ragged:  # rows of lengths[n] logits -> [N, g + 1, V], unverified positions zero
            rows = torch.cat([torch.arange(k) + i * g1 for i, k in enumerate(lengths)]).to(block.device)
            logits = logits.new_zeros(n * g1, logits.shape[-1]).index_copy(0, rows, logits)
        return logits.view(n, g1, -1), inputs, tapped

    def _graphs(self, width: int) -> VerifyGraphs | None:
        if not self.graph_verify:
            return None
        graphs = self._verify_graphs.get(width)
        if graphs is None or graphs.kv is not self.runner.kv:  # none yet, or the pools were rebuilt
            if graphs is not None:
                self._verify_graphs.clear()
            graphs = self._verify_graphs[width] = VerifyGraphs(
                self.runner, width, self.drafter.taps, capture=self.runner.device.type == "cuda"
            )
        return graphs

    def _folds(self) -> FoldGraphs:
        if self._fold_graphs is None or self._fold_graphs.states is not self.runner.states:  # pools rebuilt
            self._fold_graphs = FoldGraphs(self.runner, self.gamma + 1, capture=self.runner.device.type == "cuda")
        return self._fold_graphs

    def _window(self) -> SnapshotWindow:
        states = self.runner.states
        if self._snapshots is None or self._snapshots.states is not states:  # pools rebuilt (resume_memory)
            self._snapshots = SnapshotWindow(states, self.runner.config.max_running, self.gamma)
        return self._snapshots

    def _measure_surface(self) -> CostSurface:
        """A speculative step's time by batch and tokens per row, on this device; under TP every rank plans on
        the leader's measurement (its probes ran on all ranks), so all accept alike. The probes, and one untimed
        step of each graph bucket between the measured batches, capture the graphs a step of every bucket uses
        but for the history's (the drafter's, greedy and sampled, and the fold's), so a run that speculates
        rarely (the planner's exploring steps) does not capture them mid-run (2026-12-04, batch 256 on an
        H200: 5 of 60 steps captured, 0.71x the steady rate)."""
        max_running = self.runner.config.max_running
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_running] + [max_running]
        surface = CostSurface.measure(self._probe, sizes, self.gamma)
        between = [b for b in BATCH_BUCKETS if b < max_running and b not in sizes]  # the graphs' other buckets
        for rows in between:  # untimed: their graphs only
            self._probe(rows, self.gamma + 1)
        for rows in sizes + between:  # the sampled proposals' graphs (the probes time the greedy ones)
            self.drafter.probe(rows, self.gamma, sampled=True)
        tp = self.runner.model.model.tp
        return tp.broadcast_object(surface) if tp.size > 1 else surface

    def _probe(self, rows: int, per: int) -> None:
        """A step of `rows` rows on the pools' sink slot and sink page (they hold no request's state), graphed
        where the steps will be: the cost surface's measurement. `per` > 1: a speculative step of that width
        (the drafter's proposal, the verify forward of `per` tokens a row, a fold that commits nothing); one
        token a row: the plain step the planner runs when no drafts pay (`_plain`'s tapped decode step)."""
        kv, states = self.runner.kv, self.runner.states
        pages = [kv.sink_page] * -(-per // kv.page_size)
        fake = [_Probe(states.sink_slot, pages) for _ in range(rows)]
        if per == 1:
            self.runner.forward_tapped(fake, [0] * rows, self.drafter.taps)
        else:
            self.drafter.probe(rows, self.gamma)
            graphs = self._graphs(per)
            key = graphs.exact_key(fake) if graphs is not None else None
            if key is not None:
                block = torch.zeros(rows, per, dtype=torch.long, device=self.runner.device)
                _, inputs, _ = graphs.run(key, fake, block)
            else:
                _, inputs, _ = verify_forward(self.runner, fake, [0] * (rows * per), [per] * rows)
            if self.graph_verify and self.rollback == "replay":  # no chunk boundary in the block: one replay
                nothing = torch.zeros(rows, dtype=torch.long, device=self.runner.device)
                self._folds().fold(
                    inputs, [states.sink_slot] * rows, nothing, [0] * rows, per + 1, lambda r: [], exact=True
                )
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()


@dataclass
class _Probe:
    """What a verify forward reads of a row, for the cost probe: slot, position 0, pages, no adapter."""

    slot: int
    pages: list[int]
    pos: int = 0
    req: object = field(default_factory=lambda: type("NoAdapter", (), {"adapter": None})())


def _committed(batch: list[Running], tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[N] on the device: of row n's counts[n] emitted tokens, those it takes: up to its first stop token
    (kept) and its remaining length. The tokens past them are neither returned nor committed."""
    stops = [r.req.params.stop_token_ids for r in batch]
    left = to_device([r.req.params.max_new_tokens - len(r.req.output_ids) for r in batch], counts.device)
    counts = torch.minimum(counts, left)
    width = max(map(len, stops))
    if not width:
        return counts
    table = to_device([list(s) + [-1] * (width - len(s)) for s in stops], counts.device)
    w = tokens.shape[1]
    hit = (tokens[:, :, None] == table[:, None, :]).any(-1) & (torch.arange(w, device=counts.device) < counts[:, None])
    first = torch.where(hit.any(1), hit.long().argmax(1) + 1, counts)  # argmax: the first True
    return torch.minimum(counts, first)
