"""The cost-aware verify planner (rollout/spec/planner.py): whether draft j is verified never depends on
draft j (so sampled speculation through it keeps the target's distribution, and a rule that reads draft j
does not), the budget stops at the first loss on a staircase cost surface, a step decodes plainly where no
block pays, the engine's steps price the surface, and the engine with the planner stays lossless."""

import pytest
import torch

from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.planner import CostSurface, VerifyPlanner, budget, fill, monotone, survival, width
from rollout.spec.strategy import SpecDecode
from rollout.spec.verify import verify
from tests.rollout.common import assert_pools_drain_to_full, engine, prompt
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
        other[n, j + 1 :] = torch.rand(3 - j, generator=rng) if trial % 2 else 1.0
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


def test_a_wider_step_never_reads_cheaper_than_a_narrower_one_on_its_shelf():
    """The staircase never falls: cells that read cheaper than a narrower one are pooled with it into their
    mean, weighted by the readings behind each, so a noisy cell neither makes a wider step look cheaper nor,
    as a running maximum would, prices every wider step at its own noise."""
    surface = CostSurface({2: [(2, 2.0), (4, 2.2), (6, 4.0), (8, 2.5)]})
    assert [surface.seconds(2, t) for t in (2, 4, 6, 8)] == [2.0, 2.2, 3.25, 3.25]
    assert surface.edges(2) == [2, 4, 8]
    # read raw, the 2.5 of four tokens a row would win: (2 + 2 x 2.44) / 2.5; pooled, 6.88 / 3.25 still does
    assert width(survival(torch.full((2, 3), 0.9)), surface) == 3
    # batch 1 on the H200 (2026-12-04): a 2-token cell read 6.1 ms; as a running maximum every block cost that
    noisy = CostSurface({1: [(1, 2.06), (2, 6.13), (3, 4.44), (4, 5.60), (5, 5.37)]})
    for i, steps in ((0, 6), (3, 3), (4, 6)):  # cells that many steps confirmed weigh more than the noisy one
        noisy.observed[1, i] = [0.0] * steps
    assert [round(noisy.seconds(1, t), 3) for t in range(1, 6)] == [2.06, 5.285, 5.285, 5.447, 5.447]
    assert width(survival(torch.full((1, 4), 0.8)), noisy) == 4


def test_the_monotone_fit_pools_falling_cells_by_weight():
    assert monotone([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([1.0, 3.0, 2.0], [1, 1, 3]) == [1.0, 2.25, 2.25]
    assert monotone([5.0, 4.0, 3.0], [1, 1, 1]) == [4.0, 4.0, 4.0]
    assert monotone([1.0, 2.0], [1, 1]) == [1.0, 2.0]


def test_by_width_every_row_verifies_the_best_width_of_the_lagged_confidences():
    """Graphs cost N x w whatever is verified: the width with the most expected tokens per second, from the
    previous step's confidences only (this step's never move it); hopeless drafts verify none."""
    surface = CostSurface({2: [(2, 1.0), (4, 1.0), (6, 1.0), (8, 2.0), (10, 2.0)]})
    assert width(survival(torch.full((2, 4), 0.9)), surface) == 2  # the last width on the first shelf
    assert width(survival(torch.full((2, 4), 0.99)), surface) == 2  # (2 + 2 x 3.94) / 2 < (2 + 2 x 2.97) / 1
    assert width(survival(torch.full((2, 4), 0.0)), surface) == 0
    assert width(survival(torch.full((2, 4), 1.0)), CostSurface({2: [(2 * w, 1.0) for w in range(1, 6)]})) == 4
    risers = CostSurface({2: [(2, 1.0), (4, 1.5), (6, 1.6), (8, 2.0), (10, 2.1)]})
    planner = VerifyPlanner(risers, prior=0.9, by_width=True)
    assert planner.allot([0, 1], 4) == 4  # the prior's
    assert planner.plan([0, 1], torch.full((2, 4), 0.01), 4) == [4, 4]  # the allotted width, not 0.01's
    assert planner.allot([0, 1], 4) == 0  # last step's 0.01: a plain step, nothing drafted
    assert planner.allot([0, 1], 4) == 0 and planner.lagged[0][0] == pytest.approx(0.01)  # a plain step learns none


def test_when_no_block_pays_the_planner_decodes_plainly_and_explores_ever_more_rarely():
    """A surface on which a block costs more than its tokens (a compute-bound batch) allots nothing, from
    the lagged survivals, until `explore_every` plain steps ran in a row; then one step verifies every draft
    (its confidences refresh the lagged ones). An exploration after which the planner still decodes plainly
    doubles the wait before the next (3, then 6, then 12 plain steps), up to `explore_max`. Packed budgets
    the same."""
    dear = {4: [(4 * per, float(per)) for per in range(1, 5)]}  # a block of w tokens a row costs w plain steps
    for by_width, full in ((True, 3), (False, 12)):
        planner = VerifyPlanner(
            CostSurface({k: list(v) for k, v in dear.items()}),
            prior=0.9,
            by_width=by_width,
            explore_every=3,
            explore_max=8,
        )
        allotted = [planner.allot(list(range(4)), 3) for _ in range(42)]
        assert set(allotted) == {0, full}
        assert [i for i, a in enumerate(allotted) if a] == [3, 10, 19, 28, 37]  # waits 3, 6, 8, 8, 8
        planner.plan(list(range(4)), torch.full((4, 3), 1.0), full)
        assert planner.allot(list(range(4)), 3) == 0  # sure drafts do not pay on this surface either


def test_a_new_request_starts_from_the_last_plans_mean_survival_not_the_prior():
    """Where only good drafts pay, the fixed prior decodes plainly; once a plan has seen sure drafts, a request
    that arrives after it (no survivals of its own) is estimated at that plan's mean survival per position and
    speculates at once; unsure ones lower the estimate for the next newcomer."""
    cheap = CostSurface({2: [(2 * per, 1.0 + 0.5 * (per - 1)) for per in range(1, 5)]})
    planner = VerifyPlanner(cheap, prior=0.1, by_width=True)
    assert planner.allot([0, 1], 3) == 0  # the prior: nothing pays
    planner.allot([0, 1], 3)
    planner.plan([0, 1], torch.tensor([[1.0, 1.0, 0.9], [1.0, 0.8, 0.9]]), 3)
    assert planner.allot([7, 8], 3) == 3  # newcomers, on the last plan's estimate
    torch.testing.assert_close(planner.recent, torch.tensor([1.0, 0.9, 0.81]))
    planner.plan([7, 8], torch.full((2, 3), 0.05), 3)
    assert planner.allot([9, 10], 3) == 0


def test_a_plain_step_priced_too_high_at_start_up_is_explored_and_repriced():
    """The start-up probe priced the plain step at 10 (a slow machine's first seconds), so blocks look better;
    after `explore_every` blocks in a row one step decodes plainly (then, the plain cell still priced by its
    probe, after twice as many), its real cost (1.0) reprices the cell from its second step on, and the
    planner decodes plainly from there, exploring blocks as before."""
    surface = CostSurface({4: [(4, 10.0), (8, 3.0), (12, 3.2), (16, 3.4)]})
    planner = VerifyPlanner(surface, prior=0.5, by_width=True, learn=True, explore_every=3)
    ids, picks = list(range(4)), []
    for _ in range(20):
        a = planner.allot(ids, 3)
        picks.append(a)
        if a:
            planner.plan(ids, torch.full((4, 3), 0.5), a)
        planner.observe(4, a + 1, 1.0 if a == 0 else 3.0)
    assert picks[:11] == [3, 3, 3, 0, 3, 3, 3, 3, 3, 3, 0]  # plain explored after 3 blocks, then after 6
    assert picks[11:13] == [0, 0] and picks[13] == 3 and picks[11:].count(0) >= 7


def test_an_exploration_that_turns_the_planner_to_speculation_resets_the_wait():
    """Where a block pays only for sure drafts, the prior decodes plainly; an exploration whose confidences
    are sure makes the next step speculate, and the wait before the next exploration returns to
    `explore_every` (after a doubled one)."""
    cheap = CostSurface({4: [(4 * per, 1.0 + 0.5 * (per - 1)) for per in range(1, 5)]})
    planner = VerifyPlanner(cheap, prior=0.1, by_width=True, explore_every=3)
    ids = list(range(4))
    assert [planner.allot(ids, 3) for _ in range(11)] == [0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 3]  # waits 3, then 6
    planner.plan(ids, torch.ones(4, 3), 3)
    assert planner.allot(ids, 3) == 3 and planner.wait == 3
    planner.plan(ids, torch.zeros(4, 3), 3)
    assert [planner.allot(ids, 3) for _ in range(4)] == [0, 0, 0, 3]


def test_steps_price_the_surface_from_their_second_on_by_the_median_of_the_latest():
    """The probes time steps of rows that hold no request; `observe` puts a real step's seconds where `seconds`
    reads them (by width: the measured batch's cell for that width, whatever the rows). A cell's first step
    may compile or grow memory and is never a price; later, the price is the lower median of the probe and
    the latest five steps, so one slow step does not move it. A planner that does not learn (a given surface,
    a sharded engine) leaves its surface alone."""
    surface = CostSurface({4: [(4, 1.0), (8, 2.0)], 8: [(8, 1.0), (16, 2.0)]})
    planner = VerifyPlanner(surface, by_width=True, learn=True)
    planner.observe(3, 2, 600.0)  # 3 rows run on the batch-4 graph of width 2: its first step, a compile
    assert surface.seconds(4, 8) == 2.0
    planner.observe(4, 2, 6.0)
    assert surface.seconds(4, 8) == 2.0  # one step against the probe: the probe stands until another confirms it
    planner.observe(4, 2, 6.0)
    assert surface.seconds(4, 8) == 6.0 and surface.seconds(8, 16) == 2.0
    for sec in (5.0, 7.0, 90.0):
        planner.observe(4, 2, sec)
    assert surface.seconds(4, 8) == 6.0  # the lower median of the probe 2 and 6, 6, 5, 7, 90
    for _ in range(5):
        planner.observe(4, 2, 3.0)
    assert surface.seconds(4, 8) == 3.0  # the latest five only
    packed = VerifyPlanner(CostSurface({4: [(4, 1.0), (8, 2.0)]}), learn=True)
    for _ in range(3):
        packed.observe(4, [1, 2, 1, 1], 3.0)  # 5 tokens land on the 8-token shelf
    assert packed.surface.seconds(4, 5) == 3.0 and packed.surface.seconds(4, 4) == 1.0
    frozen = VerifyPlanner(CostSurface({4: [(4, 1.0), (8, 2.0)]}), by_width=True)
    for _ in range(2):
        frozen.observe(4, 2, 9.0)
    assert frozen.surface.seconds(4, 8) == 2.0


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


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_where_blocks_never_pay_the_engine_decodes_plainly_and_stays_lossless(overlap):
    """The cost-aware engine on a surface where a block of w tokens a row costs w plain steps: it drafts only
    on its exploring steps, decodes the rest one token a row (the drafter's windows kept current; with the
    overlap schedule, each plain step launched before the last is read), and its greedy tokens equal plain
    greedy; the pools drain. On a surface where the block is nearly free it speculates on every step."""

    prompts = [prompt(n, 60 + n) for n in (5, 9, 14)]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = engine(max_running=4).generate(prompts, params)
    for per_token, speculates in ((1.0, False), (0.01, True)):
        surface = CostSurface(
            {b: [(b * per, 1.0 + per_token * (per - 1)) for per in range(1, 5)] for b in (1, 2, 3, 4)}
        )
        spec = SpecConfig(drafter=drafter(3), gamma=3, planner="cost_aware")
        eng = engine(max_running=4, speculation=spec, overlap=overlap)
        eng.decoder.strategy = strategy = SpecDecode(eng.runner, spec, surface=surface)
        strategy.use_memory(eng.memory)
        strategy.planner.explore_every = strategy.planner.wait = 4
        got = eng.generate(prompts, params)
        for a, b in zip(want, got):
            assert a.output_ids == b.output_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        s = strategy.stats
        if speculates:
            assert s.plain_steps == 0 and s.steps > 0
        else:  # after the prior's first steps, one exploring step in five
            assert s.plain_steps > 0 and s.steps <= s.plain_steps // 4 + 2
        assert_pools_drain_to_full(eng)


def test_a_measured_surface_is_priced_by_the_steps_the_engine_runs():
    """Single-process and measured at start: the engine's steps replace their cells' probes."""
    eng = engine(max_running=4, speculation=SpecConfig(drafter=drafter(3), gamma=3, planner="cost_aware"))
    planner = eng.decoder.strategy.planner
    probed = {b: list(shelf) for b, shelf in planner.surface.table.items()}
    assert planner.learn and not planner.surface.observed
    eng.generate([prompt(7, 70), prompt(11, 71)], SamplingParams(temperature=0, max_new_tokens=8))
    observed = planner.surface.observed
    priced = [(b, i) for (b, i), steps in observed.items() if len(steps) > 2]  # two steps counted, or more
    assert priced
    for b, i in priced:  # the lower median of the probe and the counted steps' times
        readings = sorted([probed[b][i][1], *observed[b, i][1:]])
        assert planner.surface.table[b][i][1] == readings[(len(readings) - 1) // 2]
    assert any(planner.surface.table[b][i] != probed[b][i] for b, i in priced)


def test_the_planner_needs_confidences():
    from rollout.spec import Drafter

    with pytest.raises(ValueError, match="SpecConfig.planner"):
        SpecConfig(drafter=Drafter(), planner="best")
    with pytest.raises(ValueError, match="confidence head"):
        engine(speculation=SpecConfig(drafter=Drafter(), planner="cost_aware"))
