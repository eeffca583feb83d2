"""Speculative decoding in the engine (rollout/spec/strategy.py, replay.py, rollout/decode.py): greedy with
speculation is the plain engine's greedy, token for token and log-probs within 1e-4 (fp32), with prefix
hits, retraction, stop tokens and aborts; the KDA state a verify step commits and the checkpoints it plants
inside a block equal plain decoding's; a seeded sampled request does not depend on its batch; every pool
invariant holds under a fuzz; bad settings fail by field name."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import FinishReason, SamplingParams
from rollout.spec import Drafter, SpecConfig
from tests.rollout.common import MODEL, ROOMY, TIGHT, assert_pools_drain_to_full, engine, prompt

GAMMA = 3
V = MODEL.config.vocab_size


class ScriptedDrafter(Drafter):
    """Drafts a request's known continuation (`script[prompt]`, the plain engine's greedy output), each
    draft replaced by a random token with probability `wrong`, or exactly `accept` right drafts then wrong
    ones; q is one-hot on the draft (exact for how it was chosen). Records each step's committed counts."""

    def __init__(self, script: dict[tuple, list[int]], wrong: float = 0.3, accept: int | None = None):
        self.script, self.wrong, self.accept = script, wrong, accept
        self.rng = random.Random(0)
        self.counts: list[int] = []

    def propose(self, batch, anchors, gamma, params):
        rows = []
        for r in batch:
            ref, k = self.script.get(tuple(r.req.prompt_ids), []), len(r.req.output_ids)
            row = []
            for j in range(gamma):
                right = ref[k + j] if k + j < len(ref) else 3
                bad = (self.accept is not None and j >= self.accept) or (
                    self.accept is None and self.rng.random() < self.wrong
                )
                row.append((right + 1 + self.rng.randrange(V - 1)) % V if bad else right)
            rows.append(row)
        drafts = torch.tensor(rows, device=anchors.device)
        return drafts, torch.nn.functional.one_hot(drafts, V).float()

    def observe(self, batch, tapped, lengths, counts, starts):
        self.counts += counts


def spec_engine(drafter: Drafter, memory: int = ROOMY, graphs: bool = False, **kw) -> Engine:
    """graphs: verify and fold through the CUDA graphs' padded functions (run eagerly on CPU), whose fold takes
    its counts on the device; else the packed verify and the eager fold (the CPU's default)."""
    spec = SpecConfig(drafter=drafter, gamma=GAMMA)
    eng = engine(memory, speculation=spec, **kw)
    if graphs:
        from rollout.spec.strategy import SpecDecode

        eng.decoder.strategy = SpecDecode(eng.runner, spec, graphs=True)
        eng.decoder.strategy.use_memory(eng.memory)
    return eng


def script_for(prompts, params) -> dict[tuple, list[int]]:
    return {tuple(p): c.output_ids for p, c in zip(prompts, engine().generate(prompts, params))}


def step_checked(eng: Engine) -> dict:
    done = {}
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
        eng.check_invariants()
    return done


@pytest.mark.parametrize("memory", ["roomy", "tight"])
def test_greedy_speculation_equals_plain_greedy(memory):
    """Prompts sharing prefixes, length limits; roomy: a second round hits the cache and a third stops on a
    stop token; tight: requests are retracted. Every accepted length 0..gamma occurs; pools return to full."""
    roomy = memory == "roomy"
    mem, kw = (ROOMY, {}) if roomy else (TIGHT["memory"], dict(state_fraction=TIGHT["state_fraction"]))
    base = prompt(11, 1)
    prompts = [base, base + prompt(3, 2), prompt(6, 3), base[:9] + prompt(2, 4)]
    params = SamplingParams(temperature=0, max_new_tokens=14)
    plain = engine(mem, **kw)
    want = [plain.generate(prompts, params)]
    rounds = [params]
    if roomy:
        stop = want[0][2].output_ids[4]
        stopping = SamplingParams(temperature=0, max_new_tokens=14, stop_token_ids=(stop,))
        want += [plain.generate(prompts, params), engine(mem, **kw).generate(prompts, stopping)]
        rounds += [params, stopping]
    drafter = ScriptedDrafter({tuple(p): c.output_ids for p, c in zip(prompts, want[0])})
    eng = spec_engine(drafter, mem, **kw)
    got = []
    for ps in rounds:
        ids = [eng.submit(p, ps) for p in prompts]
        done = step_checked(eng)
        got.append([done[i] for i in ids])
    for a_round, b_round in zip(want, got):
        for a, b in zip(a_round, b_round):
            assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert set(drafter.counts) == set(range(1, GAMMA + 2))
    if roomy:
        assert sum(c.cached_tokens for c in got[1]) > 0
        assert any(c.finish_reason == FinishReason.STOP for c in got[2])
    else:
        assert eng.counters()["retractions"] > 0
    assert_pools_drain_to_full(eng)


def working_state(eng: Engine, rid: int) -> dict:
    r = next(r for r in eng.scheduler.running if r.req.request_id == rid)
    return {
        i: (eng.states.conv[i][r.slot].clone(), eng.states.recurrent[i][r.slot].clone()) for i in eng.states.kda_layers
    }


@pytest.mark.parametrize("accept", range(GAMMA + 1))
def test_the_committed_kda_state_equals_plain_decode_for_every_accepted_length(accept):
    """One verify step keeping `accept` drafts leaves, in every KDA layer, the conv and recurrent state that
    plain decoding of the same tokens leaves (fp32; the verify's projections come from a packed forward)."""
    p = prompt(9, 5)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    spec = spec_engine(ScriptedDrafter(script_for([p], params), accept=accept))
    rid = spec.submit(p, params)
    while not spec.scheduler.running or spec.scheduler.running[0].prefilling:
        spec.step()  # prefill (its last chunk may stop short of the prompt's end: a decode step feeds the rest)
    before = len(spec.scheduler.running[0].req.output_ids)
    spec.step()  # the verify step
    emitted = before + accept + 1
    assert len(spec.scheduler.running[0].req.output_ids) == emitted
    plain = engine()
    pid = plain.submit(p, params)
    while not plain.scheduler.running or len(plain.scheduler.running[0].req.output_ids) < emitted:
        plain.step()
    assert plain.scheduler.running[0].pos == spec.scheduler.running[0].pos
    got, want = working_state(spec, rid), working_state(plain, pid)
    for layer in want:
        torch.testing.assert_close(got[layer], want[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("accept", [None, 1])
def test_a_block_reaching_a_chunk_boundary_checkpoints_the_plain_state(accept, graphs):
    """Chunks of 8: a 6-token prompt's first block commits positions 6..9 (every draft right), crossing 8
    inside the block, or 6..7 (one right), ending on it; the checkpoint the tree gets at 8 equals the plain
    engine's. Graphed, the fold does not know its counts and checkpoints every row that may reach 8: the
    ones that do not are freed (the pools drain)."""
    p = prompt(6, 6)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    spec = spec_engine(ScriptedDrafter(script_for([p], params), wrong=0.0, accept=accept), graphs=graphs)
    plain = engine()
    outs = [e.generate([p], params)[0] for e in (spec, plain)]
    assert outs[0].output_ids == outs[1].output_ids
    tokens = p + outs[0].output_ids
    found = [e.memory.match(None, tokens) for e in (spec, plain)]
    assert found[0].prefix_len == found[1].prefix_len == 8
    for layer in spec.states.kda_layers:
        for table in ("conv", "recurrent"):
            a, b = (getattr(e.states, table)[layer][m.checkpoint_slot] for e, m in zip((spec, plain), found))
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert spec.decoder.strategy.stats.steps == (2 if accept is None else 3)
    assert_pools_drain_to_full(spec)


def test_a_seeded_sampled_request_does_not_depend_on_its_batch():
    """Temperature 1 with a scripted drafter: the seeded request's tokens and log-probs are the same alone
    and in a batch with other requests (its drafts and verify draws come from its own generator)."""
    p, others = prompt(7, 7), [prompt(n, 8 + n) for n in (4, 10)]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    script = script_for([p, *others], SamplingParams(temperature=0, max_new_tokens=10))
    alone = spec_engine(ScriptedDrafter(script)).generate([p], params)[0]
    mixed = spec_engine(ScriptedDrafter(script)).generate(
        [others[0], p, others[1]],
        [
            SamplingParams(temperature=1.0, max_new_tokens=10, seed=9),
            params,
            SamplingParams(temperature=0.7, top_k=20, max_new_tokens=8, seed=1),
        ],
    )[1]
    assert alone.output_ids == mixed.output_ids
    assert alone.logprobs == pytest.approx(mixed.logprobs, abs=1e-5)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), memory=st.sampled_from([TIGHT["memory"], ROOMY]), graphs=st.booleans())
def test_fuzz_with_speculation_keeps_every_pool_invariant(seed, memory, graphs):
    """Random shared-prefix requests, greedy and sampled, aborts and pool pressure: the accounting holds
    after every step, the engine drains, every page and slot comes back (graphed: the fold's checkpoints of
    rows that did not reach their boundary too)."""
    rng = random.Random(seed)
    eng = spec_engine(ScriptedDrafter({}, wrong=0.5), memory, graphs=graphs, state_fraction=0.95)
    bases = [prompt(24, 100 + i) for i in range(2)]
    for _ in range(16):
        if rng.random() < 0.4:
            p = rng.choice(bases)[: rng.randrange(1, 24)] + prompt(rng.randrange(0, 4), rng.randrange(10**6))
            eng.submit(
                p,
                SamplingParams(
                    temperature=rng.choice([0, 1.0]), max_new_tokens=rng.randrange(1, 9), seed=rng.randrange(100)
                ),
            )  # <= 36 tokens + a block: fits 11 pages
        elif eng.scheduler.running and rng.random() < 0.15:
            eng.abort(rng.choice(eng.scheduler.running).req.request_id)
        eng.step()
        eng.check_invariants()
    for _ in range(500):
        if not eng.has_work():
            break
        eng.step()
        eng.check_invariants()
    assert not eng.has_work(), "engine made no progress"
    assert_pools_drain_to_full(eng)


def test_bad_speculation_settings_fail_by_field_name():
    with pytest.raises(ValueError, match="SpecConfig.gamma"):
        SpecConfig(drafter=Drafter(), gamma=0)
    with pytest.raises(ValueError, match="SpecConfig.drafter"):
        SpecConfig(drafter=3)
    with pytest.raises(ValueError, match="EngineConfig.speculation"):
        Engine(MODEL, EngineConfig(memory_bytes=ROOMY, speculation={"gamma": 2}))

    class Short(Drafter):
        max_gamma = 2

    with pytest.raises(ValueError, match="SpecConfig.gamma"):
        Engine(MODEL, EngineConfig(memory_bytes=ROOMY, speculation=SpecConfig(drafter=Short(), gamma=3)))


def test_a_request_sized_to_the_whole_pool_finishes_near_its_length_limit():
    """The pool holds exactly prompt + max_new_tokens positions: a verify block near the end must not ask for
    pages past the limit (the request would retract itself, then crawl a token per retraction)."""
    pool_tokens = 11 * 4  # TIGHT: 11 pages of 4 tokens
    params = SamplingParams(temperature=0, max_new_tokens=14)
    p = prompt(pool_tokens - params.max_new_tokens, 7)
    eng = spec_engine(ScriptedDrafter(script_for([p], params), wrong=0.0), **TIGHT)
    rid = eng.submit(p, params)
    done = {}
    for _ in range(100):
        done.update({c.request_id: c for c in eng.step()})
        if rid in done:
            break
    assert rid in done and eng.counters()["retractions"] == 0
    assert done[rid].output_ids == engine().generate([p], params)[0].output_ids
