"""A drafter of controlled acceptance, for measuring speculation's costs on a target no drafter was trained for.

    drafter = ControlledDrafter({tuple(p): c.output_ids for p, c in zip(prompts, plain_outputs)}, vocab_size, 0.8)
    Engine(model, EngineConfig(..., speculation=SpecConfig(drafter=drafter, gamma=4)))

A trained drafter's acceptance depends on the target and the task; the engine's cost of speculation (the
verify forward of gamma + 1 tokens per row, the fold, the planner) does not. This drafter knows the
target's greedy continuation of each prompt (from a plain greedy run of the same engine settings) and
proposes, at every draft position independently, the target's next token with probability `acceptance`
and another token otherwise: greedy verification then keeps each draft with probability `acceptance` given
the earlier ones survived, whatever the weights (a random-init k3-small included). Greedy rows only: only
greedy verification keeps its drafts at the stated rate, and it reads no q, so none is returned (a one-hot
q would be exact).
Confidences are each row's own rate (the cost-aware planner then has true confidences to rank by). Draws
come from its own seeded generator, not the rows'.

`acceptance` is one rate for every row, or a range (lo, hi): each prompt then gets its own rate, uniform in
it (seeded), as chat traffic mixes easy and hard requests. With one rate the planner has nothing to rank and
sets its budget from the cost surface alone; with a range it can spend the verify tokens on the rows that
keep them.

`shadow`: a real drafter (an untrained `DSparkDrafter` of the shape one would train) that runs alongside at
every call (attach, prefill windows, propose, observe) and whose drafts are dropped: its taps, context
windows and block forward cost what a trained one's cost, while acceptance stays the controlled rate. So a
bench of speculation's costs includes the drafter's own, on a target no drafter was trained for.
"""

from __future__ import annotations

import torch

from rollout.spec.drafter import Drafter


class ControlledDrafter(Drafter):
    has_confidence = True

    def __init__(
        self,
        continuations: dict[tuple[int, ...], list[int]],
        vocab_size: int,
        acceptance: float | tuple[float, float],
        seed: int = 0,
        shadow: Drafter | None = None,
    ):
        lo, hi = acceptance if isinstance(acceptance, tuple) else (acceptance, acceptance)
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"acceptance must be a rate or a range lo <= hi inside [0, 1], got {acceptance}")
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        draws = torch.rand(len(continuations), generator=self.generator, dtype=torch.float64).tolist()
        self.rates = {p: lo + (hi - lo) * u for p, u in zip(continuations, draws)}
        # one row per prompt, its continuation zero-padded, so a batch's truth is one gather (a loop over rows
        # building tensors was milliseconds of host time a step at batch 256: the bench's, not the engine's)
        self._row = {p: i for i, p in enumerate(continuations)}
        width = max((len(c) for c in continuations.values()), default=0)
        self._truth = torch.zeros(len(continuations), width + 1, dtype=torch.long)
        for i, c in enumerate(continuations.values()):
            self._truth[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        self._rates = torch.tensor(list(self.rates.values()), dtype=torch.float32)
        self.shadow = shadow
        if shadow is not None:
            self.max_gamma = shadow.max_gamma

    def attach(self, runner) -> None:
        if self.shadow is not None:
            self.shadow.attach(runner)
            self.taps = self.shadow.taps  # the strategy reads these during prefill and verify, for the shadow

    @property
    def captures(self) -> int:
        return 0 if self.shadow is None else self.shadow.captures

    def probe(self, rows, gamma, sampled=False) -> None:
        if self.shadow is not None:
            self.shadow.probe(rows, gamma, sampled)

    def observe(self, batch, tapped, lengths, counts, starts) -> None:
        if self.shadow is not None:
            self.shadow.observe(batch, tapped, lengths, counts, starts)

    def observe_plain(self, batch, tapped, starts) -> None:
        if self.shadow is not None:
            self.shadow.observe_plain(batch, tapped, starts)

    def prefilled(self, rows, spans, tapped) -> None:
        if self.shadow is not None:
            self.shadow.prefilled(rows, spans, tapped)

    def propose(self, batch, anchors, gamma, params):
        if any(p.temperature > 0 for p in params):
            raise ValueError("ControlledDrafter drafts for greedy rows only")
        if self.shadow is not None:  # its cost, not its drafts
            self.shadow.propose(batch, anchors, gamma, params)
        n, v = len(batch), self.vocab_size
        rows = torch.tensor([self._row[tuple(r.req.prompt_ids)] for r in batch], dtype=torch.long)
        done = torch.tensor([len(r.req.output_ids) for r in batch], dtype=torch.long)
        # past its continuation's end a row drafts 0s (its padding), as it did token by token
        at = (done[:, None] + torch.arange(gamma)).clamp(max=self._truth.shape[1] - 1)
        truth = self._truth[rows[:, None], at]
        rates = self._rates[rows]
        keep = torch.rand(n, gamma, generator=self.generator) < rates[:, None]
        other = (truth + torch.randint(1, v, (n, gamma), generator=self.generator)) % v  # never the target's
        drafts = torch.where(keep, truth, other).to(anchors.device)
        conf = rates[:, None].expand(n, gamma).to(anchors.device)
        return drafts, None, conf  # q: none for greedy rows (a one-hot over k3-small's vocabulary: 0.7 GB at 256)
