"""The cost-aware verify planner (rollout/spec/planner.py): whether draft j is verified never depends on
draft j (so sampled speculation through it keeps the target's distribution, and a rule that reads draft j
does not), the budget stops at the first loss on a staircase cost surface, and the engine with the planner
stays lossless."""

import pytest
import torch

from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.planner import CostSurface, VerifyPlanner, budget, fill, survival, width
from rollout.spec.verify import verify
from tests.rollout.common import engine, prompt
from tests.rollout.test_spec_drafter import drafter
from tests.rollout.test_spec_verify import ROWS, chi2, chi2_bound, exact, speculate, tables


def test_the_decision_at_j_never_reads_the_draft_at_j():
    """Draft j shapes the confidences after it (c_{j+1} reads x_j): rewriting every confidence after j, of
    its row, leaves whether j is verified unchanged, whatever the budget."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(200):
        conf = torch.rand(5, 4, generator=rng)
        if trial % 3 == 0:
            conf[conf > 0.6] = 1.0  # ties along a row
        tokens = trial % 21
        counts = fill(survival(conf), tokens)
        n, j = trial % 5, trial % 4
        other = conf.clone()
        other[n, j + 1:] = torch.rand(3 - j, generator=rng) if trial % 2 else 1.0
        assert (fill(survival(other), tokens)[n] > j) == (counts[n] > j)
        assert sum(counts) == tokens


def test_the_budget_stops_at_the_first_loss_on_a_staircase():
    """Shelves: 1-8 total tokens cost 1, 9-16 cost 3. Rows that survive get verified up to the shelf's
    edge and no further (the riser costs more than it returns); hopeless drafts get no budget."""
    surface = CostSurface({2: [(t, 1.0 if t <= 8 else 3.0) for t in range(1, 17)]})
    assert budget(survival(torch.full((2, 7), 0.99)), surface) == 6  # 2 anchors + 6 drafts = 8 tokens
    assert budget(survival(torch.full((2, 7), 0.0)), surface) == 0


def test_the_budget_climbs_a_riser_for_the_whole_shelf_above_it():
    """A measured surface has a price per batch-wide step (4 rows: 4, 8, 12, ... tokens): one more token
    never pays the riser to 8, the shelf it opens does (4 rows x 0.9 survive); the budget stops at the
    shelf edge before the steep riser to 16."""
    surface = CostSurface({4: [(4, 1.0), (8, 1.5), (12, 1.6), (16, 2.5), (20, 2.6)]})
    lagged = survival(torch.full((4, 4), 0.9))
    assert surface.edges(4) == [4, 8, 12, 16, 20] and surface.edges(3) == [4, 8, 12, 16, 20]
    assert budget(lagged, surface) == 8  # 4 rows x (0.9 + 0.81) kept: (4 + 6.84) / 1.6 beats 13.76 / 2.5
    flat = CostSurface({4: [(t, 1.0 if t <= 12 else 2.0) for t in range(1, 21)]})
    assert flat.edges(4) == [12, 20] and budget(lagged, flat) == 8


def test_by_width_every_row_verifies_the_best_width_of_the_lagged_confidences():
    """Graphs cost N x w whatever is verified: the width with the most expected tokens per second, from the
    previous step's confidences only (this step's never move it); hopeless drafts verify none."""
    surface = CostSurface({2: [(2, 1.0), (4, 1.0), (6, 1.0), (8, 2.0), (10, 2.0)]})
    assert width(survival(torch.full((2, 4), 0.9)), surface) == 2  # the last width on the first shelf
    assert width(survival(torch.full((2, 4), 0.99)), surface) == 2  # (2 + 2 x 3.94) / 2 < (2 + 2 x 2.97) / 1
    assert width(survival(torch.full((2, 4), 0.0)), surface) == 0
    assert width(survival(torch.full((2, 4), 1.0)), CostSurface({2: [(2 * w, 1.0) for w in range(1, 6)]})) == 4
    risers = CostSurface({2: [(2, 1.0), (4, 1.5), (6, 1.6), (8, 2.0), (10, 2.1)]})
    planner = VerifyPlanner(risers, prior=0.9)
    assert planner.plan([0, 1], torch.full((2, 4), 0.01), by_width=True) == [4, 4]  # the prior's, not 0.01's
    assert planner.plan([0, 1], torch.full((2, 4), 0.99), by_width=True) == [0, 0]  # last step's 0.01
    assert planner.plan([0, 1], torch.full((2, 4), 0.99), by_width=True) == [4, 4]


def test_sampled_speculation_through_the_planner_keeps_the_target_distribution():
    """Chains as in test_spec_verify, each block verifying a prefix chosen from confidences that read only
    earlier drafts: the law of the sequences is the target's; a rule that verifies draft j only when q(x_j)
    is low (it reads draft j) fails the same test."""
    target, draft = tables(0)
    params = SamplingParams(temperature=1.0)
    probs = exact(target, params)
    df = len(probs) - 1

    def planned(logits, drafts, q, plist, seeds, at):
        conf = torch.cat([torch.ones(len(drafts), 1), (drafts[:, :-1] % 2).float() * 0.8 + 0.1], 1)  # reads x_<j
        return verify(logits, drafts, q, plist, seeds, at, fill(survival(conf), len(drafts)))

    def lossy(logits, drafts, q, plist, seeds, at):
        qx = q.gather(2, drafts[..., None])[..., 0]
        keep = [int((row < 0.5).long().cumprod(0).sum()) for row in qx]  # reads x_j itself
        return verify(logits, drafts, q, plist, seeds, at, keep)

    assert chi2(speculate(target, draft, params, ROWS, planned), probs) < chi2_bound(df)
    assert chi2(speculate(target, draft, params, ROWS // 2, lossy), probs) > 3 * chi2_bound(df)


def test_the_engine_with_the_planner_is_lossless():
    """Greedy through the cost-aware planner (the surface measured at start on this CPU) equals plain
    greedy; rows verify different numbers of drafts."""
    prompts = [prompt(n, 30 + n) for n in (5, 9, 14)]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    want = engine(max_running=4).generate(prompts, params)
    eng = engine(max_running=4, speculation=SpecConfig(drafter=drafter(3), gamma=3, planner="cost_aware"))
    assert sorted(eng.decoder.strategy.planner.surface.table) == [1, 2, 4]
    got = eng.generate(prompts, params)
    for a, b in zip(want, got):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_the_planner_needs_confidences():
    from rollout.spec import Drafter

    with pytest.raises(ValueError, match="SpecConfig.planner"):
        SpecConfig(drafter=Drafter(), planner="best")
    with pytest.raises(ValueError, match="confidence head"):
        engine(speculation=SpecConfig(drafter=Drafter(), planner="cost_aware"))
