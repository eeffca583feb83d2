"""The DSpark drafter (rollout/spec/drafter.py): the q it reports is the distribution it drew from, the
target context it keeps per request equals a fresh target pass over the request's tokens (a group's shared
prompt computed once), a saved drafter
loads to the same drafts, bad directories and mismatched targets fail by name, and the engine stays
lossless with it."""

import json

import pytest
import torch

from rollout.forward import DecodeGraphs, hooks
from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.drafter import DSparkConfig, DSparkDrafter, _features
from tests.rollout.common import MODEL, assert_pools_drain_to_full, engine, prompt

C = MODEL.config


def drafter(seed: int = 0, cls: type = DSparkDrafter, **kw) -> DSparkDrafter:
    torch.manual_seed(seed)
    d = cls(
        DSparkConfig(
            target_layers=(1, 4),
            hidden_size=C.hidden_size,
            vocab_size=C.vocab_size,
            block_size=3,
            context_window=16,
            **kw,
        )
    )
    with torch.no_grad():  # a drafter with something to say: non-zero Markov head and temperatures
        d.markov_out.weight.normal_(0, 0.5)
        d.pos_embed.normal_(0, 0.1)
        d.log_temperature.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return d


def test_the_reported_q_is_the_distribution_each_draft_was_drawn_from():
    """Drafts are drawn left to right through the Markov head; q from `propose` equals the teacher-forced
    softmax of the same block given those drafts (temperature 1, fp32), greedy drafts are its argmax, and
    the confidences are the teacher-forced ones."""
    d = drafter()
    d.share(MODEL)
    ctx = torch.randn(5, 7, 2 * C.hidden_size)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2, 4:] = False
    anchors = torch.tensor([5, 9, 11, 40, 3])
    feats = [ctx[i, mask[i]] for i in range(5)]

    class Row:  # what propose reads of a Running: its request (id, seed) and its position
        def __init__(self, i):
            self.req = type("R", (), {"request_id": i, "finish_reason": None, "seed": 40 + i})()
            self.pos = 3 * i

    rows = [Row(i) for i in range(5)]
    counts = [len(f) for f in feats]
    with torch.no_grad():  # the windows keep the draft layers' keys and values of the features
        kv = d.context(torch.cat(feats))
    d.contexts.append([r.req for r in rows], kv, [sum(counts[:i]) for i in range(5)], counts, counts)
    params = [SamplingParams(temperature=1.0)] * 4 + [SamplingParams(temperature=0)]
    drafts, q, reported_conf = d.propose(rows, anchors, 3, params)
    with torch.no_grad():
        logits, conf = d.teacher_forced(ctx, mask, anchors, drafts)
    torch.testing.assert_close(q[:4], logits[:4].softmax(-1), atol=1e-6, rtol=1e-5)
    assert drafts[4].tolist() == logits[4].argmax(-1).tolist()
    torch.testing.assert_close(reported_conf, conf, atol=1e-6, rtol=1e-5)  # c_k reads drafts before k only
    assert ((conf > 0) & (conf < 1)).all()


def test_engine_context_equals_a_fresh_target_pass_and_greedy_stays_lossless():
    """With a (random) DSpark drafter the engine's greedy output is the plain engine's; the context the
    drafter kept for a request (a catch-up pass for its prompt, then each verify's committed tokens) equals
    the tapped states of one target pass over the request's computed tokens."""
    d = drafter(1)
    prompts = [prompt(7, 20), prompt(12, 21)]
    params = SamplingParams(temperature=0, max_new_tokens=9)
    want = engine().generate(prompts, params)
    eng = engine(speculation=SpecConfig(drafter=d, gamma=3))
    rid = eng.submit(prompts[1], params)
    for _ in range(3):
        eng.step()
    r = eng.scheduler.running[0]
    store: dict = {}
    with hooks(d.taps, store), torch.inference_mode():
        MODEL.model.hidden(torch.tensor(r.tokens[: r.pos])[None], None, None)
    fresh = d.context(_features(store, d.config.target_layers)[0, -16:])
    kept = d.contexts.get(rid)
    assert kept.shape == fresh.shape
    torch.testing.assert_close(kept, fresh, atol=1e-4, rtol=1e-4)
    while eng.has_work():
        eng.step()
    got = eng.generate(prompts, params)
    for a, b in zip(want, got):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert not d.contexts.ids() - {c.request_id for c in got}  # finished requests' contexts are dropped


def test_a_groups_catch_up_computes_each_distinct_prefix_once():
    """Three samples of one prompt (a GRPO group) and one other prompt catch up in a pass over two rows, and each
    sample's window equals a fresh target pass over its own tokens."""
    from types import SimpleNamespace

    d = drafter(3)
    engine(speculation=SpecConfig(drafter=d, gamma=3))  # attaches the drafter to an engine's runner
    a, b = prompt(20, 40), prompt(9, 41)
    rows = [
        SimpleNamespace(
            req=SimpleNamespace(request_id=i, adapter=None, media=None, finish_reason=None), pos=len(t), tokens=t
        )
        for i, t in enumerate([a, b, a, a])
    ]
    fed = []
    handle = MODEL.model.embed_tokens.register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    try:
        d._catch_up(rows)
    finally:
        handle.remove()
    assert fed == [len(a) + len(b)]
    for r in rows:
        store: dict = {}
        with hooks(d.taps, store), torch.inference_mode():
            MODEL.model.hidden(torch.tensor(r.tokens)[None], None, None)
        torch.testing.assert_close(
            d.contexts.get(r.req.request_id),
            d.context(_features(store, d.config.target_layers)[0, -16:]),
            atol=1e-4,
            rtol=1e-4,
        )


class CatchUps(DSparkDrafter):
    """Records the requests each catch-up pass computed."""

    def __init__(self, config):
        super().__init__(config)
        self.caught: list[int] = []

    def _catch_up(self, rows) -> None:
        self.caught += [r.req.request_id for r in rows]
        super()._catch_up(rows)


def fresh_window(d, r) -> torch.Tensor:
    store: dict = {}
    with hooks(d.taps, store), torch.inference_mode():
        MODEL.model.hidden(torch.tensor(r.tokens[: r.pos])[None], None, None)
        return d.context(_features(store, d.config.target_layers)[0, -d.config.context_window :])


def test_windows_come_from_the_engines_prefill_and_a_short_suffix_after_a_hit_catches_up():
    """Prompts prefilled from position 0 (one over two prefill steps) need no catch-up pass: their windows
    come from the engine's prefill. After a prefix hit, a computed suffix of a window or more does not either;
    a shorter one catches up. Every window equals a fresh target pass over the request's computed tokens,
    and greedy output stays the plain engine's."""
    d = drafter(5, cls=CatchUps)
    eng = engine(speculation=SpecConfig(drafter=d, gamma=3))  # 16 prompt tokens a prefill step, chunks of 8
    a, b = prompt(20, 50), prompt(9, 51)
    long_tail, short_tail = a[:16] + prompt(18, 52), a[:16] + prompt(5, 53)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    ids = [eng.submit(p, params) for p in (a, b)]
    while len(eng.scheduler.running) < 2 or not all(r.pos > len(p) for r, p in zip(eng.scheduler.running, (a, b))):
        eng.step()
    assert d.caught == []
    assert eng.memory.match(None, short_tail).prefix_len == 16  # both tails will hit a's first 16 tokens
    ids += [eng.submit(p, params) for p in (long_tail, short_tail)]
    for _ in range(6):
        eng.step()
    assert d.caught == [ids[3]]
    for r in eng.scheduler.running:
        if r.req.request_id in d.contexts:
            torch.testing.assert_close(d.contexts.get(r.req.request_id), fresh_window(d, r), atol=1e-4, rtol=1e-4)
    done = {}
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
    want = engine().generate([a, b, long_tail, short_tail], params)
    assert [done[i].output_ids for i in ids] == [w.output_ids for w in want]


@pytest.mark.parametrize("graphed", [False, True])
def test_above_max_batch_plain_steps_keep_the_window_current_and_the_output_plain_decodings(graphed):
    """SpecConfig.max_batch=2 over four requests of different lengths: while more than two decode, each step is
    a plain one (one token a row, the drafter fed its taps: eagerly, or from the decode graphs' tapped variant,
    padded shapes run eagerly here), then the last two speculate. After plain steps every window equals a fresh
    target pass over the request's tokens (no catch-up needed), the greedy output is plain decoding's, and a
    chunk boundary a plain step reached is checkpointed for the prefix cache."""
    d = drafter(2)
    prompts = [prompt(n, 30 + n) for n in (5, 9, 13, 17)]
    params = [SamplingParams(temperature=0, max_new_tokens=m) for m in (4, 6, 14, 16)]
    want = engine().generate(prompts, params)
    eng = engine(speculation=SpecConfig(drafter=d, gamma=3, max_batch=2))
    if graphed:
        eng.graphs = DecodeGraphs(eng.model, eng.kv, eng.states, max_batch=4, max_seq_len=256, capture=False)
    ids = [eng.submit(p, q) for p, q in zip(prompts, params)]
    stats = eng.decoder.strategy.stats
    done = {}
    while eng.has_work() and stats.plain_steps < 2:
        done.update((c.request_id, c) for c in eng.step())
    assert stats.plain_steps == 2 and stats.steps == 0 and len(eng.scheduler.running) == 4
    for r in eng.scheduler.running:
        torch.testing.assert_close(d.contexts.get(r.req.request_id), fresh_window(d, r), atol=1e-4, rtol=1e-4)
    while ids[0] not in done:
        done.update((c.request_id, c) for c in eng.step())
    plain = stats.plain_steps
    done.update((c.request_id, c) for c in eng.step())  # three rows: plain still, and nothing proposes
    assert stats.plain_steps == plain + 1 and ids[0] not in d.contexts  # a finished request's window is freed
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
    assert stats.steps > 0 and stats.plain_steps >= 2
    for rid, w in zip(ids, want):
        assert done[rid].output_ids == w.output_ids
        assert done[rid].logprobs == pytest.approx(w.logprobs, abs=1e-4)
    if graphed:
        assert any("tapped" in key for key in eng.graphs.graphs)
    # request 2 (13 prompt tokens) crossed the chunk boundary at 16 in a plain step: its checkpoint is in the
    # prefix cache, and a prompt extending its tokens resumes there with plain decoding's continuation
    again = prompts[2] + want[2].output_ids[:5]
    hit = eng.generate([again], SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert hit.cached_tokens == 16
    assert hit.output_ids == engine().generate([again], SamplingParams(temperature=0, max_new_tokens=4))[0].output_ids


@pytest.mark.parametrize("graphed", [False, True])
def test_plain_steps_overlap_as_plain_decoding_does_and_speculation_resumes_after_them(graphed):
    """With the overlap schedule, a plain step (over max_batch) is launched before the previous plain step is
    read, as plain decoding's are; once the batch fits max_batch the pipeline reads first and the rows
    speculate. Greedy tokens and log-probs equal plain decoding's, every plain step is read once, the pools
    drain. The drafter's windows take each plain step's taps as it is launched: with a step in flight every
    window equals a fresh target pass up to the row's pos, also when the taps come from the decode graphs'
    outputs, which the next step's replay (enqueued before this step is read) refills."""
    d = drafter(2)
    prompts = [prompt(n, 50 + n) for n in (5, 9, 13, 17)]
    params = [SamplingParams(temperature=0, max_new_tokens=m) for m in (5, 7, 14, 16)]
    want = engine(overlap="off").generate(prompts, params)
    eng = engine(overlap="on", speculation=SpecConfig(drafter=d, gamma=3, max_batch=2))
    if graphed:
        eng.graphs = DecodeGraphs(eng.model, eng.kv, eng.states, max_batch=4, max_seq_len=256, capture=False)
    strategy = eng.decoder.strategy
    ids = [eng.submit(p, q) for p, q in zip(prompts, params)]
    done, in_flight, checked = {}, 0, 0
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
        if getattr(eng.decoder.inflight, "plain", False):
            in_flight += 1
            for r in eng.decoder.inflight.batch:
                if r in eng.scheduler.running:
                    torch.testing.assert_close(
                        d.contexts.get(r.req.request_id), fresh_window(d, r), atol=1e-4, rtol=1e-4
                    )
                    checked += 1
        eng.check_invariants()
    assert in_flight > 3 and checked > 8 and strategy.stats.steps > 0 and strategy.unread == 0
    for rid, w in zip(ids, want):
        assert done[rid].output_ids == w.output_ids
        assert done[rid].logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert_pools_drain_to_full(eng)


def test_a_verify_step_launched_into_an_unread_plain_step_is_refused():
    """A strategy that says it continues into a step that is not plain (here: always) would verify rows whose
    last token and position the host has not read: SpecDecode refuses that launch."""
    from rollout.spec.strategy import SpecDecode

    class Continues(SpecDecode):
        def continues(self, batch):
            return True

    spec = SpecConfig(drafter=drafter(2), gamma=3, max_batch=2)
    eng = engine(overlap="on", speculation=spec)
    eng.decoder.strategy = Continues(eng.runner, spec)
    eng.decoder.strategy.use_memory(eng.memory)
    for p in (prompt(n, 60 + n) for n in (5, 9, 13)):
        eng.submit(p, SamplingParams(temperature=0, max_new_tokens=6))
    with pytest.raises(RuntimeError, match="plain step in flight"):
        while eng.has_work():
            eng.step()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graphed_proposals_equal_the_eager_block_at_every_bucket(temperature):
    """`DraftGraphs` at its padded shapes (run eagerly here, as capture=False does) proposes what the eager
    block does for batches of 1-6 rows in any buffer order: the same drafts and confidences, and for sampled
    rows (their temperatures, seeds and positions as tensors: `draw_scaled`) the same q as `draw` with the
    rows' settings. A bucket is captured on its third ask (a larger captured graph serves it until then); a
    context buffer that grows drops the graphs."""
    from types import SimpleNamespace

    from rollout.sampler import truncates

    d = drafter(3)
    eng = engine(speculation=SpecConfig(drafter=d, gamma=3), max_running=6)
    d.attach(eng.runner, graphs=True)
    g = torch.Generator().manual_seed(0)
    reqs = [SimpleNamespace(request_id=i, finish_reason=None) for i in range(6)]
    feats = torch.randn(6 * 16, 2 * C.hidden_size * d.config.num_layers, generator=g)  # keys and values
    d.contexts.append(reqs, feats, [16 * i for i in range(6)], [4 + 2 * i for i in range(6)], [20] * 6)
    for n in (6, 1, 3, 3, 3, 5):
        ids = [5 - i for i in range(n)]
        batch = [SimpleNamespace(req=SimpleNamespace(request_id=i, seed=100 + i), pos=20 + i) for i in ids]
        params = [SamplingParams(temperature=temperature * (1 + 0.1 * i)) for i in range(n)]
        assert not truncates(params, C.vocab_size)
        anchors = torch.randint(3, C.vocab_size, (n,), generator=g)
        graphs, d.graphs = d.graphs, None
        want = d.propose(batch, anchors, 3, params)  # eager: `draw` with the rows' settings
        d.graphs = graphs
        got = d.propose(batch, anchors, 3, params)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[2], want[2], atol=1e-6, rtol=1e-5)
        if temperature:
            torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
        else:
            assert got[1] is want[1] is None
    assert sorted(k[0] for k in d.graphs.graphs) == [4, 6]  # 1 and the first two 3s padded to 6; the third 3 gets 4
    more = [SimpleNamespace(request_id=i, finish_reason=None) for i in range(6, 12)]
    d.contexts.append(more, feats, [0] * 6, [1] * 6, [1] * 6)  # past the buffer's 8 rows: it grows
    d.graphs.run(d.contexts.rows([11]), anchors[:1], 3)
    assert list(d.graphs.graphs) == [(1, 0, 3, False)]


def test_greedy_speculation_through_a_graphed_drafter_equals_plain_greedy():
    """The engine's steps draft through `DraftGraphs` (padded shapes, eager on CPU): greedy equals plain greedy,
    the proposals come from the graphs, and their captures count in the strategy's."""
    d = drafter(4)
    prompts = [prompt(n, 90 + n) for n in (5, 9, 13)]
    params = SamplingParams(temperature=0, max_new_tokens=9)
    want = engine().generate(prompts, params)
    eng = engine(speculation=SpecConfig(drafter=d, gamma=3), max_running=4)
    d.attach(eng.runner, graphs=True)
    got = eng.generate(prompts, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert d.graphs.replays == eng.decoder.strategy.stats.steps > 0
    assert eng.decoder.strategy.stats.captures == d.graphs.captures > 0


def test_sampled_speculation_through_a_graphed_drafter_draws_what_the_eager_drafter_draws():
    """Seeded sampled rows: the graphed drafter's drafts and q are the eager one's, so the engine emits the
    same tokens and log-probs either way (the sampled proposals came from the graphs)."""
    prompts = [prompt(n, 95 + n) for n in (5, 9, 13)]
    params = [SamplingParams(temperature=t, max_new_tokens=9) for t in (1.0, 0.7, 1.3)]
    runs = []
    for graphed in (False, True):
        d = drafter(5)
        eng = engine(speculation=SpecConfig(drafter=d, gamma=3), max_running=4)
        d.attach(eng.runner, graphs=graphed)
        runs.append([(c.output_ids, c.logprobs) for c in eng.generate(prompts, params)])
        if graphed:
            assert any(key[3] for key in d.graphs.graphs) and d.graphs.replays == eng.decoder.strategy.stats.steps
    for (ids_e, lp_e), (ids_g, lp_g) in zip(*runs):
        assert ids_g == ids_e
        assert lp_g == pytest.approx(lp_e, abs=1e-5)


def test_a_retracted_request_prefilled_again_keeps_a_true_window():
    """Tight pools retract requests mid-decode; prefilled again from their prefix hit, they repeat positions
    their windows hold: after every step each window still equals a fresh target pass, and greedy output
    stays the plain engine's."""
    from tests.rollout.common import TIGHT

    d = drafter(6)
    eng = engine(TIGHT["memory"], state_fraction=TIGHT["state_fraction"], speculation=SpecConfig(drafter=d, gamma=3))
    base = prompt(11, 60)
    prompts = [base, base + prompt(3, 61), prompt(6, 62), base[:9] + prompt(2, 63)]
    params = SamplingParams(temperature=0, max_new_tokens=14)
    ids = [eng.submit(p, params) for p in prompts]
    done, checked = {}, 0
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
        for r in eng.scheduler.running:
            if r.req.request_id in d.contexts and d.contexts.end(r.req.request_id) == r.pos:
                torch.testing.assert_close(d.contexts.get(r.req.request_id), fresh_window(d, r), atol=1e-4, rtol=1e-4)
                checked += 1
    assert eng.counters()["retractions"] > 0 and checked > 0
    want = engine().generate(prompts, params)
    assert [done[i].output_ids for i in ids] == [w.output_ids for w in want]


def test_save_load_round_trip_and_bad_directories(tmp_path):
    d = drafter(2)
    d.save(tmp_path / "dr")
    back = DSparkDrafter.load(tmp_path / "dr", MODEL)
    assert back.config == d.config
    for (k, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="model.safetensors"):
        (tmp_path / "half").mkdir()
        (tmp_path / "half" / "config.json").write_text(json.dumps({}))
        DSparkDrafter.load(tmp_path / "half")
    cfg = json.loads((tmp_path / "dr" / "config.json").read_text())
    (tmp_path / "dr" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 7}))
    with pytest.raises(ValueError, match="DSparkConfig.vocab_size"):
        DSparkDrafter.load(tmp_path / "dr", MODEL)
    with pytest.raises(ValueError, match="DSparkConfig.target_layers"):
        DSparkConfig(target_layers=(9,), hidden_size=C.hidden_size, vocab_size=C.vocab_size).check_target(C)
    with pytest.raises(ValueError, match="SpecConfig.drafter"):
        engine(speculation=SpecConfig(drafter=tmp_path / "nowhere"))
