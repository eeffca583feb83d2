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

The budget is the batch's, so with this planner a seeded request's tokens (not their distribution) can
depend on what it is batched with; `verify_all` keeps them batch-independent.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch


@dataclass
class CostSurface:
    """Step seconds of a verify forward by (rows, total tokens), measured once on the device it runs on.
    `seconds` reads the staircase: the smallest measured batch >= rows, then the smallest measured total
    >= tokens at that batch (the shelf the step lands on)."""

    table: dict[int, list[tuple[int, float]]]  # rows -> [(total tokens, seconds)] sorted by tokens

    def seconds(self, rows: int, tokens: int) -> float:
        sizes = sorted(self.table)
        b = sizes[min(bisect.bisect_left(sizes, rows), len(sizes) - 1)]
        shelf = self.table[b]
        i = min(bisect.bisect_left([t for t, _ in shelf], tokens), len(shelf) - 1)
        return shelf[i][1]

    def edges(self, rows: int) -> list[int]:
        """Each shelf's far edge at `rows` rows (the measured batch `seconds` reads): the most total tokens
        before the price changes, ascending."""
        sizes = sorted(self.table)
        shelf = self.table[sizes[min(bisect.bisect_left(sizes, rows), len(sizes) - 1)]]
        return [t for k, (t, s) in enumerate(shelf) if k + 1 == len(shelf) or shelf[k + 1][1] != s]

    @classmethod
    def measure(cls, step, batches: list[int], gamma: int, repeats: int = 3) -> "CostSurface":
        """`step(rows, tokens_per_row)` runs one verify forward of that shape; the median of `repeats`
        timed runs after one warm-up, for every batch and 1..gamma + 1 tokens per row."""
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
    """Drafts every row verifies when the step costs N x w whatever is verified (graphs), from the previous
    step's survival estimates [N, G]: the d in 0..G whose expected tokens per second is the highest."""
    n, g = lagged.shape
    expected = [n + e for e in torch.cat([lagged.new_zeros(1), lagged.float().sum(0).cumsum(0)]).tolist()]
    rates = [expected[d] / surface.seconds(n, n * (d + 1)) for d in range(g + 1)]
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
    """Per step: `plan(rows, current confidences)` -> drafts to verify per row, keeping the step's
    survivals per request for the next step's budget (a request with none yet counts `prior` per draft)."""

    def __init__(self, surface: CostSurface, prior: float = 0.5):
        self.surface, self.prior = surface, prior
        self.lagged: dict[int, torch.Tensor] = {}  # request id -> its previous step's survival [G]

    def plan(self, request_ids: list[int], conf: torch.Tensor, by_width: bool = False) -> list[int]:
        """Drafts to verify per row (module docstring): packed, or `by_width` (every row the same count)."""
        n, g = conf.shape
        prior = survival(torch.full((1, g), self.prior))[0]
        lagged = torch.stack([self.lagged.get(rid, prior)[:g] for rid in request_ids])
        current = survival(conf)
        self.lagged = {rid: s for rid, s in zip(request_ids, current)}
        if by_width:
            return [width(lagged, self.surface)] * n
        return fill(current, budget(lagged, self.surface))
