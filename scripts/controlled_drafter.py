"""A drafter of controlled acceptance, for measuring speculation's costs on a target no drafter was trained for.

    drafter = ControlledDrafter({tuple(p): c.output_ids for p, c in zip(prompts, plain_outputs)}, vocab_size, 0.8)
    Engine(model, EngineConfig(..., speculation=SpecConfig(drafter=drafter, gamma=4)))

A trained drafter's acceptance depends on the target and the task; the engine's cost of speculation (the
verify forward of gamma + 1 tokens per row, the fold, the planner) does not. This drafter knows the
target's greedy continuation of each prompt (from a plain greedy run of the same engine settings) and
proposes, at every draft position independently, the target's next token with probability `acceptance`
and another token otherwise: greedy verification then keeps each draft with probability `acceptance` given
the earlier ones survived, whatever the weights (a random-init k3-small included). Greedy rows only: its
q is one-hot on each draft, which is exact, but only a greedy target accepts it at the stated rate.
Confidences are the constant `acceptance` (the cost-aware planner then sets its budget from the cost surface
alone). Draws come from its own seeded generator, not the rows'.
"""

from __future__ import annotations

import torch

from rollout.spec.drafter import Drafter


class ControlledDrafter(Drafter):
    has_confidence = True

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab_size: int, acceptance: float,
                 seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.continuations, self.vocab_size, self.acceptance = continuations, vocab_size, acceptance
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, batch, anchors, gamma, params, generators):
        if any(p.temperature > 0 for p in params):
            raise ValueError("ControlledDrafter drafts for greedy rows only")
        n, v = len(batch), self.vocab_size
        truth = torch.zeros(n, gamma, dtype=torch.long)
        for i, r in enumerate(batch):
            future = self.continuations[tuple(r.req.prompt_ids)][len(r.req.output_ids):][:gamma]
            truth[i, :len(future)] = torch.tensor(future, dtype=torch.long)
        keep = torch.rand(n, gamma, generator=self.generator) < self.acceptance
        other = (truth + torch.randint(1, v, (n, gamma), generator=self.generator)) % v  # never the target's
        drafts = torch.where(keep, truth, other).to(anchors.device)
        q = torch.zeros(n, gamma, v, device=anchors.device).scatter_(2, drafts[..., None], 1.0)  # one-hot, fp32 only
        conf = torch.full((n, gamma), self.acceptance, device=anchors.device)
        return drafts, q, conf
