"""The cost-aware verify planner: how many of each row's drafts one verify forward checks.

Verifying every draft of every row (`verify_all`) pays for tokens that will be rejected, and a verify
forward's time is not linear in its tokens: measured on a device it is a staircase of flat shelves (the
kernels' tiles fill up) and steep risers. The planner spends tokens where they are expected to survive
and stops where the next shelf costs more than it returns. Two shapes of verify forward, two rules:

- packed (eager; rows verify ragged prefixes, the step costs its total tokens): the budget (how many
  draft tokens in total) is set from the previous step's confidences (lagged): each row's survival
  estimates s_{n,k} = c_{n,1} ... c_{n,k}, sorted, fill the surface's shelves one at a time, and the
  expected tokens (rows + sum of the taken s) over the shelf's measured step time are compared at each
  shelf's far edge (the most tokens at that price: a riser is worth climbing only for the whole shelf
  above it); the budget is the last shelf before the first that does not raise tokens per second. The
  current step's confidences only rank which positions fill that budget: the top positions by current
  survival, earlier positions first on ties, so each row gets a prefix (`budget`, `fill`).
- by width (CUDA graphs: every row feeds the same w tokens, so the step costs N x w whichever positions
  are verified): the lagged survivals choose the width with the most expected tokens per second, and
  every row verifies w - 1 drafts, which the graph computes anyway (`width`). The few widths are each
  measured, so the best is taken outright: expected tokens are concave in w and the price never falls, so
  the first loss and the best agree but for measurement noise, which the best does not stop at.

Lossless: the confidence of draft k reads the drafts before k only (`DSparkDrafter`: the block output
h_k and W1[x_{k-1}]), survival along a row never increases, and ties go to the earlier position, so
whether draft j is verified depends on the drafts before j and on other rows, never on draft j itself
(by width: on the previous step only): verification then keeps each emitted token's distribution the
target's. A rule that read draft j (say, verifying it only when q(x_j) is high) would bias what is emitted.

No drafts at all is a plan too: when the lagged survivals do not pay for a block at this batch (budget or
width 0), the step decodes one token a row without drafting (the strategy's plain step), and the
surface's one-token-a-row shelf is priced as that plain step. Where a block costs nearly its tokens' worth
(k3-small at batch 256 on an H200: 5 tokens a row are 2.4 plain steps of work, for 3.3 kept) the planner
then decodes plainly, and speculates again where a step is bound by launches and bytes (small batches). A
run of plain steps learns no confidences, so after `explore_every` of them one step verifies every draft.
Such a step costs a block's whole price (k3-small at batch 256 on an H200, 2026-12-04: 15.4 ms against a
4.0 ms plain step), so an exploration whose fresh survivals still choose plain steps doubles the wait
before the next one (up to `explore_max` plain steps), and one that turns the planner to speculation
resets it: where blocks never pay the explorations cost a vanishing share of the run. The other way too:
a run of speculative steps prices no plain step, and a plain cell priced too high at start-up (the same
code's batch-256 plain probe read 4.2, 5.4 and 8.2 ms on three H200s, 2026-12-04) would keep the planner
speculating where it loses, so after `explore_every` blocks in a row one step decodes plainly, with the
same backoff.

The probes time whole steps on rows that hold no request (the proposal, the verify forward, a fold that
commits nothing: `SpecDecode._probe`), but not a real batch's host work, histories or drafts kept. So the
steps the engine runs price the surface too (`observe`, single-process engines): from a
cell's second real step on, the lower median of its probe and its latest steps is its price (a cell's first
step, and a step that captured a graph, may compile or capture: not counted; one slow step moves no price
until another confirms it); a step's time runs from its launch, or from the previous read when it was
launched before that (an overlapped plain step), to its read. Prices are read as a staircase that never
falls (`CostSurface.seconds`): where a cell reads dearer than a wider one, the two are pooled, weighted by
the readings behind each (the monotone least-squares fit), so a cell priced by a few noisy steps can make
neither a wider verify look cheaper than a narrower one nor every wider one dear (2026-12-04, batch 1 on
the H200: a 2-token cell read 6.1 ms against 4.4-5.6 ms for 3-5 tokens and, as a running maximum, priced
every block out). A sharded engine's ranks time differently and must plan alike, so they plan on the
leader's start-up surface only.

The budget is the batch's, so with this planner a seeded request's tokens (not their distribution) can
depend on what it is batched with, and, with steps observed, on the machine's timings; `verify_all` keeps
them batch-independent.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from rollout.transfer import to_host


@dataclass
class CostSurface:
    """Step seconds by (rows, total tokens), probed at start-up on the device it runs on (`measure`), then
    priced by the steps the engine runs (`observe`).
    `seconds` reads the staircase: the smallest measured batch >= rows, then the smallest measured total
    >= tokens at that batch (the shelf the step lands on). One token a row is the plain step's price."""

    table: dict[int, list[tuple[int, float]]]  # rows -> [(total tokens, seconds)] sorted by tokens
    observed: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (batch, shelf index) -> steps
    probed: dict[tuple[int, int], float] = field(default_factory=dict)  # a cell's price before its first step

    def batch(self, rows: int) -> int:
        """The measured batch whose shelf `rows` rows are priced on."""
        sizes = sorted(self.table)
        return sizes[min(bisect.bisect_left(sizes, rows), len(sizes) - 1)]

    def _cell(self, rows: int, tokens: int) -> tuple[int, int]:
        b = self.batch(rows)
        shelf = self.table[b]
        return b, min(bisect.bisect_left([t for t, _ in shelf], tokens), len(shelf) - 1)

    def seconds(self, rows: int, tokens: int) -> float:
        """The step's price on the staircase fitted to the cells of its batch (`_prices`): a step of more tokens
        never costs less."""
        b, i = self._cell(rows, tokens)
        return self._prices(b)[i]

    def _prices(self, b: int) -> list[float]:
        """The batch's cells as a non-decreasing staircase: each cell weighted by the readings behind it (its
        probe and the steps it keeps), cells that fall below a narrower one pooled into their weighted mean."""
        weights = [max(len(self.observed.get((b, i), ())), 1) for i in range(len(self.table[b]))]
        return monotone([s for _, s in self.table[b]], weights)

    def observe(self, rows: int, tokens: int, seconds: float, recent: int = 5) -> None:
        """A whole step the engine ran, read where `seconds(rows, tokens)` reads. A cell's first step is left
        out (a shape's first run may compile a kernel or grow the allocator: such steps read 0.3-0.7 s on the
        H200, 2026-12-04, which priced plain steps out for good); from the second on, the cell's price is the
        lower median of its probe and its latest `recent` steps, so one slow step (a collection, a compile)
        does not move it until another confirms it."""
        b, i = self._cell(rows, tokens)
        self.probed.setdefault((b, i), self.table[b][i][1])
        seen = self.observed.setdefault((b, i), [])
        seen.append(seconds)
        del seen[1:-recent]  # the first step (never a price) and the latest `recent`
        if len(seen) > 1:
            readings = sorted([self.probed[b, i], *seen[1:]])
            self.table[b][i] = (self.table[b][i][0], readings[(len(readings) - 1) // 2])

    def edges(self, rows: int) -> list[int]:
        """Each shelf's far edge at `rows` rows (the measured batch `seconds` reads): the most total tokens
        before the price changes, ascending."""
        b = self.batch(rows)
        tokens, prices = [t for t, _ in self.table[b]], self._prices(b)
        return [t for k, (t, s) in enumerate(zip(tokens, prices)) if k + 1 == len(prices) or prices[k + 1] != s]

    @classmethod
    def measure(cls, step, batches: list[int], gamma: int, repeats: int = 3) -> "CostSurface":
        """`step(rows, tokens_per_row)` runs one forward of that shape (one token a row: the plain step);
        the median of `repeats` timed runs after one warm-up, for every batch and 1..gamma + 1 tokens per row."""
        table = {}
        for b in batches:
            shelf = []
            for per in range(1, gamma + 2):
                step(b, per)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    step(b, per)
                    times.append(time.perf_counter() - t0)
                shelf.append((b * per, sorted(times)[len(times) // 2]))
            table[b] = shelf
        return cls(table)


def monotone(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool adjacent violators: a
    value below the one before it is pooled with it into their weighted mean, until none falls)."""
    pools: list[list[float]] = []  # [weighted sum, weight, cells]
    for v, w in zip(values, weights):
        pools.append([v * w, w, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, weight, cells = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += weight
            pools[-1][2] += cells
    return [total / weight for total, weight, cells in pools for _ in range(cells)]


def survival(conf: torch.Tensor) -> torch.Tensor:
    """Confidences [N, G] (c_k: draft k survives given the earlier ones did) -> cumulative survival [N, G]."""
    return conf.float().cumprod(dim=1)


def budget(lagged: torch.Tensor, surface: CostSurface) -> int:
    """Draft tokens to verify this step (packed), from the previous step's survival estimates [N, G]: the
    shelves' far edges in turn, until the first whose expected tokens per second does not beat the last."""
    n = lagged.shape[0]
    gains = lagged.flatten().sort(descending=True).values.cumsum(0).tolist()
    best_taken, best = 0, float(n) / surface.seconds(n, n)
    for edge in surface.edges(n):
        taken = min(max(edge - n, 0), len(gains))
        if taken <= best_taken:
            continue
        rate = (n + gains[taken - 1]) / surface.seconds(n, n + taken)
        if rate <= best:
            break
        best_taken, best = taken, rate
    return best_taken


def width(lagged: torch.Tensor, surface: CostSurface) -> int:
    """Drafts every row verifies when the step costs its graph's bucket x w whatever is verified, from the
    previous step's survival estimates [N, G]: the d in 0..G whose expected tokens per second is the highest
    (priced at the measured batch the rows run on, as `VerifyPlanner.observe` records them)."""
    n, g = lagged.shape
    b = surface.batch(n)
    expected = [n + e for e in torch.cat([lagged.new_zeros(1), lagged.float().sum(0).cumsum(0)]).tolist()]
    rates = [expected[d] / surface.seconds(b, b * (d + 1)) for d in range(g + 1)]
    return max(range(g + 1), key=lambda d: (rates[d], -d))


def fill(current: torch.Tensor, tokens: int) -> list[int]:
    """Drafts to verify per row: the `tokens` positions of highest current survival [N, G], earlier
    positions first on ties (then lower rows): a prefix of each row."""
    n, g = current.shape
    keys = sorted(((-float(s), k, row) for row, ss in enumerate(current.tolist()) for k, s in enumerate(ss)))
    counts = [0] * n
    for _, _, row in keys[:tokens]:
        counts[row] += 1
    return counts


class VerifyPlanner:
    """Per step, before drafting: `allot(rows, gamma)` -> the step's width or token budget from the lagged
    survivals (0: a plain step, no drafts); after drafting: `plan(rows, current confidences, allotted)` ->
    drafts to verify per row, keeping the step's survivals per request for the next step's (a request with
    none yet counts the last plan's mean survival per position, or `prior` per draft before any plan: with
    the fixed prior a new request on a surface where only good drafts pay decoded plainly until an
    exploration, 16 plain steps a request at batch 1 on the H200, 2026-12-04). `by_width`: plan widths
    (graphed verify), else packed budgets. `observe`: a step's wall time prices the surface (module
    docstring), when `learn`."""

    def __init__(
        self,
        surface: CostSurface,
        prior: float = 0.5,
        by_width: bool = False,
        learn: bool = False,
        explore_every: int = 16,
        explore_max: int = 512,
    ):
        self.surface, self.prior, self.by_width, self.learn = surface, prior, by_width, learn
        self.explore_every, self.explore_max = explore_every, explore_max
        self.wait = explore_every  # plain steps in a row before a block is explored (module docstring)
        self.block_wait = explore_every  # speculative steps in a row before a plain step is explored
        self.plain_run = 0  # plain steps in a row, the planner's choice
        self.block_run = 0  # speculative steps in a row
        self._explored: str | None = None  # the last allotment explored ("block" or "plain"): the next one judges it
        self.lagged: dict[int, torch.Tensor] = {}  # request id -> its previous step's survival [G], on the host
        self.recent: torch.Tensor | None = None  # the last plan's mean survival [G]: a new request's estimate
        self._copied: tuple | None = None  # the last plan's (request ids, survivals on their way to the host, event)
        # the last choice's ((request ids, g), their lagged survivals [N, g]): stacking them is most of a choice's
        # host time, and nothing changes them between plans
        self._rows: tuple | None = None

    def choose(self, request_ids: list[int], g: int) -> int:
        """From the previous step's survivals only: every row's drafts (by width) or the batch's draft tokens
        (packed); 0 decodes one token a row. Exploring: after `wait` plain steps in a row, all drafts; after
        `block_wait` speculative steps in a row, a plain step. Changes nothing: `allot` is this choice,
        counted. Reads host tensors only: the strategy asks it (`SpecDecode.continues`) with a plain step in
        flight, which a device read would wait for."""
        return self._choice(request_ids, g)[0]

    def _choice(self, request_ids: list[int], g: int) -> tuple[int, str | None]:
        """`choose`'s answer and what it explores, if anything."""
        self._settle()
        key = (tuple(request_ids), g)
        if self._rows is None or self._rows[0] != key:  # a run of plain steps asks of the same rows each step
            prior = survival(torch.full((1, g), self.prior))[0] if self.recent is None else self.recent
            self._rows = key, torch.stack([self.lagged.get(rid, prior)[:g] for rid in request_ids])
        lagged = self._rows[1]
        allotted = width(lagged, self.surface) if self.by_width else budget(lagged, self.surface)
        if allotted == 0 and self.plain_run >= self.wait:
            return (g if self.by_width else g * len(request_ids)), "block"
        if allotted and self.block_run >= self.block_wait:
            return 0, "plain"
        return allotted, None

    def allot(self, request_ids: list[int], g: int) -> int:
        """`choose`, counted: the runs of plain and speculative steps it makes; the first choice after an
        exploration doubles the wait before the next of its kind when the explored step did not turn the
        planner (up to `explore_max`), else sets it back to `explore_every`."""
        allotted, exploring = self._choice(request_ids, g)
        if self._explored == "block":
            self.wait = min(2 * self.wait, self.explore_max) if allotted == 0 else self.explore_every
        elif self._explored == "plain":
            self.block_wait = min(2 * self.block_wait, self.explore_max) if allotted else self.explore_every
        self._explored = exploring
        self.plain_run, self.block_run = (self.plain_run + 1, 0) if allotted == 0 else (0, self.block_run + 1)
        return allotted

    def plan(self, request_ids: list[int], conf: torch.Tensor, allotted: int) -> list[int]:
        """Drafts to verify per row (module docstring) for `allot`'s nonzero answer; the current confidences
        [N, G] rank the positions (packed) and become the next step's lagged survivals."""
        current = survival(conf)
        self._copied = (list(request_ids), *to_host(current))  # read by the next `choose`, after this step's read
        return [allotted] * len(request_ids) if self.by_width else fill(current, allotted)

    def _settle(self) -> None:
        """The last plan's survivals as the lagged ones. Its step was read before the next choice (a verify step
        is read before anything is launched after it), so its copy is done and this does not wait."""
        if self._copied is not None:
            ids, host, ready = self._copied
            if ready is not None:
                ready.synchronize()
            self.lagged, self._copied, self._rows = dict(zip(ids, host)), None, None
            if len(ids):
                self.recent = host.mean(0)

    def observe(self, rows: int, per: int | list[int], seconds: float) -> None:
        """A step that ran `rows` rows, `per` tokens each (a graph's width) or per[n] (packed), in `seconds`."""
        if not self.learn:
            return
        if self.by_width:
            b = self.surface.batch(rows)
            self.surface.observe(b, b * per, seconds)
        else:
            self.surface.observe(rows, per * rows if isinstance(per, int) else sum(per), seconds)
