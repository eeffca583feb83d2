"""The CUDA-graph verify's padded shapes (rollout/spec/graphs.py), run eagerly on CPU (capture=False): every
row feeds gamma + 1 tokens in an [N, gamma + 1] batch padded to its bucket with sink rows, rows near their
length limit included (their extra tokens write the sink page); greedy equals plain greedy token for token
(log-probs within 1e-4), the committed KDA states equal the packed verify's, every pool invariant holds and
the pools drain. The GPU twin (graphs captured and replayed) is tests/gpu/test_spec_gpu.py."""

import torch

from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.strategy import SpecDecode
from tests.rollout.common import assert_pools_drain_to_full, engine, prompt
from tests.rollout.test_spec_engine import GAMMA, ScriptedDrafter, script_for


def padded_engine(drafter, **kw):
    """An engine whose verify runs through VerifyGraphs' padded shapes (eagerly: the CPU has no graphs)."""
    spec = SpecConfig(drafter=drafter, gamma=GAMMA)
    eng = engine(speculation=spec, max_running=6, **kw)
    eng.decoder.strategy = SpecDecode(eng.runner, spec, graphs=True)
    eng.decoder.strategy.use_memory(eng.memory)
    return eng


def test_padded_verify_equals_plain_greedy_and_the_packed_verify():
    """Five requests (batch buckets 1, 2, 4, 6: five rows take bucket 6, one a sink row); limits of 9 and
    11 new tokens, so blocks run past a row's limit; shared prefixes hit the cache."""
    base = prompt(10, 31)
    ps = [base + prompt(3, 32), base, prompt(5, 33), prompt(17, 34), base[:6] + prompt(4, 35)]
    params = [SamplingParams(temperature=0, max_new_tokens=9 if i % 2 else 11) for i in range(len(ps))]
    script = script_for(ps, params)
    plain = engine().generate(ps, params)
    packed = engine(speculation=SpecConfig(drafter=ScriptedDrafter(script), gamma=GAMMA), max_running=6)
    padded = padded_engine(ScriptedDrafter(script))
    ids = [[e.submit(p, sp) for p, sp in zip(ps, params)] for e in (packed, padded)]
    done = [{}, {}]
    while packed.has_work() or padded.has_work():
        for e, d in zip((packed, padded), done):
            d.update((c.request_id, c) for c in e.step())
            e.check_invariants()
        for a, b in zip(packed.scheduler.running, padded.scheduler.running):
            assert a.pos == b.pos
            for layer in packed.states.kda_layers:
                for table in ("conv", "recurrent"):
                    torch.testing.assert_close(
                        getattr(padded.states, table)[layer][b.slot],
                        getattr(packed.states, table)[layer][a.slot],
                        atol=1e-5,
                        rtol=1e-5,
                    )
    for want, a, b in zip(plain, *ids):
        for got in (done[0][a], done[1][b]):
            assert got.output_ids == want.output_ids
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
    graphs = padded.decoder.strategy._verify_graphs[GAMMA + 1]
    assert graphs.replays == padded.decoder.strategy.stats.steps > 0
    stats = padded.decoder.strategy.stats  # padded shapes run eagerly here: no step counts as graphed
    assert stats.verify_graphed == stats.fold_graphed == 0
    # the first step captured bucket 6; smaller batches replayed it until a bucket was asked for three times
    assert min(graphs.graphs)[0] >= 2 and max(graphs.graphs)[0] == 6
    assert stats.captures == len(graphs.graphs) + len(padded.decoder.strategy._folds().graphs)
    assert padded.decoder.strategy.stats.accepted > 0
    assert_pools_drain_to_full(padded)


def test_graphs_serve_verify_all_only_and_the_cpu_verifies_eagerly_by_default():
    """Graphs serve both planners (the cost-aware one by width, its cost surface measured on them); the CPU
    verifies eagerly unless told otherwise."""
    from rollout.spec.drafter import DSparkConfig, DSparkDrafter
    from tests.rollout.common import MODEL

    c = MODEL.config
    d = DSparkDrafter(
        DSparkConfig(target_layers=(1,), hidden_size=c.hidden_size, vocab_size=c.vocab_size, block_size=GAMMA)
    )
    eng = engine(speculation=SpecConfig(drafter=d, gamma=GAMMA), max_running=2)
    assert not eng.decoder.strategy.graph_verify  # CPU: eager by default
    assert SpecDecode(eng.runner, SpecConfig(drafter=d, gamma=GAMMA), graphs=True).graph_verify
    planned = SpecConfig(drafter=d, gamma=GAMMA, planner="cost_aware")
    strategy = SpecDecode(eng.runner, planned, graphs=True)  # the surface is measured on the graphs' shapes
    # one token a row is priced as the plain step (a decode step), so verify graphs of width 2 and up
    assert strategy.graph_verify and sorted(strategy._verify_graphs) == list(range(2, GAMMA + 2))


class ConfidentDrafter(ScriptedDrafter):
    """ScriptedDrafter whose rows alternate sure (0.95) and unsure (0.2) confidences: a planner gives the sure
    rows longer prefixes than the unsure ones, so its verify widths vary."""

    has_confidence = True

    def propose(self, batch, anchors, gamma, params):
        drafts, q = super().propose(batch, anchors, gamma, params)
        sure = torch.tensor([0.95 if r.req.request_id % 2 == 0 else 0.2 for r in batch], device=anchors.device)
        return drafts, q, sure[:, None].expand(len(batch), gamma)


def test_the_planner_verifies_through_graphs_by_width_and_stays_lossless():
    """Under the cost-aware planner every row feeds the batch's longest verified prefix + 1 tokens (a graph
    per width), shorter rows verify only their own drafts: greedy equals plain greedy, pools drain."""
    from rollout.spec.planner import CostSurface

    base = prompt(9, 41)
    ps = [base + prompt(2, 42), prompt(6, 43), base, prompt(12, 44)]
    params = [SamplingParams(temperature=0, max_new_tokens=8) for _ in ps]
    plain = engine().generate(ps, params)
    script = {tuple(p): c.output_ids for p, c in zip(ps, plain)}
    drafter = ConfidentDrafter(script, wrong=0.1)
    eng = engine(speculation=SpecConfig(drafter=drafter, gamma=GAMMA), max_running=6)
    # a known staircase instead of the CPU's timings: each extra position per row costs 15% of a step more
    surface = CostSurface({b: [(b * per, 1.0 + 0.15 * (per - 1)) for per in range(1, GAMMA + 2)] for b in (1, 2, 4, 6)})
    spec = SpecConfig(drafter=drafter, gamma=GAMMA, planner="cost_aware")
    eng.decoder.strategy = strategy = SpecDecode(eng.runner, spec, graphs=True, surface=surface)
    strategy.use_memory(eng.memory)
    done = {}
    for p, sp in zip(ps, params):
        eng.submit(p, sp)
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
        eng.check_invariants()
    for want, got in zip(plain, [done[i] for i in sorted(done)]):
        assert got.output_ids == want.output_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
    used = {w for w, g in strategy._verify_graphs.items() if g.replays}
    assert len(used) >= 2 and max(used) <= GAMMA + 1  # ragged plans ran at more than one width
    assert strategy.stats.accepted > 0
    assert_pools_drain_to_full(eng)


def test_the_start_up_probes_capture_every_batchs_drafter_and_fold_graphs_before_any_request():
    """The cost-aware planner's start-up probes run whole speculative steps of each batch they measure (the drafter's
    proposal, the verify forward, a fold that commits nothing), each from its bucket's own graph, one untimed step
    of every other bucket, and the sampled proposals too: every bucket's drafter graphs (greedy and sampled) and
    fold graph exist before the first request, so a run that speculates captures none of them. The probes touch no
    request's state: greedy output equals plain greedy."""
    from rollout.spec.planner import CostSurface
    from tests.rollout.test_spec_drafter import drafter

    d = drafter(3)
    eng = engine(speculation=SpecConfig(drafter=d, gamma=GAMMA), max_running=14)
    spec = SpecConfig(drafter=d, gamma=GAMMA, planner="cost_aware")
    # a speculating surface for the run; the probes' own measurement below is the CPU's
    cheap = CostSurface({b: [(b * per, 1.0 + 0.01 * (per - 1)) for per in range(1, GAMMA + 2)] for b in (1, 2, 4)})
    eng.decoder.strategy = strategy = SpecDecode(eng.runner, spec, graphs=True, surface=cheap)
    strategy.use_memory(eng.memory)
    d.attach(eng.runner, graphs=True)  # padded proposals, run eagerly on CPU
    measured = strategy._measure_surface()
    assert sorted(measured.table) == [1, 2, 4, 8, 14]  # timed; bucket 12's graphs captured untimed
    buckets = [1, 2, 4, 8, 12, 14]
    assert sorted(d.graphs.graphs) == [(b, 0, GAMMA, s) for b in buckets for s in (False, True)]
    assert sorted(strategy._fold_graphs.graphs) == buckets
    drafts, folds, replays = d.graphs.captures, strategy._fold_graphs.captures, strategy._fold_graphs.replays
    ps = [prompt(n, 120 + n) for n in (5, 9, 13)]
    params = SamplingParams(temperature=0, max_new_tokens=10)
    got = eng.generate(ps, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in engine().generate(ps, params)]
    assert strategy.stats.steps > 0 and strategy._fold_graphs.replays > replays and d.graphs.replays > 0
    assert (d.graphs.captures, strategy._fold_graphs.captures) == (drafts, folds)
    assert_pools_drain_to_full(eng)
