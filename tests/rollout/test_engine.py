"""Engine vs the reference model: greedy parity, log-probs, prefix hits, branches, retraction, errors."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.generate import greedy_generate
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import FinishReason, SamplingParams

torch.manual_seed(0)
MODEL = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
SMALL = dict(page_size=4, chunk_size=8, max_prefill_tokens=16, max_seq_len=256)
ROOMY = 8 << 20


def engine(memory=ROOMY, **kw):
    return Engine(MODEL, EngineConfig(memory_bytes=memory, **{**SMALL, **kw}))


def prompt(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cold(p, params):
    return engine().generate([p], params)[0]


GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


def test_greedy_output_and_logprobs_equal_the_reference_model():
    prompts = [prompt(n, i) for i, n in enumerate([1, 7, 8, 9, 30, 41])]
    outs = engine().generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        want, want_lp = greedy_generate(MODEL, torch.tensor([p]), 10)
        assert out.output_ids == want[0].tolist()
        torch.testing.assert_close(torch.tensor(out.logprobs), want_lp[0], rtol=0, atol=1e-4)
        assert out.finish_reason == FinishReason.LENGTH


def test_prefix_hit_gives_exactly_the_cold_output():
    eng = engine()
    p = prompt(37, 1)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=12)
    first = eng.generate([p], params)[0]
    again = eng.generate([p], params)[0]
    assert first.cached_tokens == 0 and again.cached_tokens == 32  # deepest chunk checkpoint below 37
    assert again.output_ids == first.output_ids == cold(p, params).output_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    eng.check_invariants()


def test_branch_point_is_planted_and_reused():
    eng = engine(max_prefill_tokens=32)
    base = prompt(40, 2)
    eng.generate([base], GREEDY)
    b = base[:21] + prompt(10, 3)  # diverges mid-edge at 21 -> fork at 16
    out_b = eng.generate([b], GREEDY)[0]
    assert out_b.cached_tokens == 0  # no checkpoint at or above the fork yet: replay from 0, plant at 16
    c = base[:19] + prompt(6, 4)
    out_c = eng.generate([c], GREEDY)[0]
    assert out_c.cached_tokens == 16
    assert out_b.output_ids == cold(b, GREEDY).output_ids and out_c.output_ids == cold(c, GREEDY).output_ids


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_retraction_under_memory_pressure_loses_and_duplicates_nothing(overlap):
    prompts = [prompt(20, 10 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_new_tokens=24)
    eng = engine(memory=360_000, state_fraction=0.95, overlap=overlap)  # 4 state slots, 11 pages of 4 tokens
    outs = eng.generate(prompts, params)
    assert eng.num_retractions > 0
    for p, out in zip(prompts, outs):
        assert out.output_ids == cold(p, params).output_ids
    eng.check_invariants()
    eng._evict_pages(10**9)
    eng._evict_checkpoints(10**9)
    assert eng.kv.allocator.num_free == eng.kv.allocator.capacity
    assert eng.states.allocator.num_free == eng.states.allocator.capacity


def test_bad_requests_are_rejected_without_disturbing_others():
    eng = engine()
    ok = eng.submit(prompt(5, 5), GREEDY)
    for bad, match in [([], "empty"), ([1, 999], "outside"), (prompt(250, 6), "max_seq_len")]:
        with pytest.raises(ValueError, match=match):
            eng.submit(bad, GREEDY)
    with pytest.raises(ValueError, match="KV pages"):
        engine(memory=360_000, state_fraction=0.95).submit(prompt(60, 6), GREEDY)
    for bad, match in []:
        with pytest.raises(ValueError, match=match):
            eng.submit(bad, GREEDY)
    with pytest.raises(ValueError, match="unknown adapter"):
        eng.submit(prompt(3, 7), GREEDY, adapter="nope")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    done = []
    while eng.has_work():
        done += eng.step()
    assert [c.request_id for c in done] == [ok]
    assert done[0].output_ids == cold(prompt(5, 5), GREEDY).output_ids


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_abort_stop_tokens_and_stream(overlap):
    eng = engine(overlap=overlap)
    a, b = prompt(12, 8), prompt(9, 9)
    ra, rb = eng.submit(a, GREEDY), eng.submit(b, GREEDY)
    for _ in range(4):  # prefill, then decode steps (with overlap, one of them enqueued, not read back)
        eng.step()
    aborted = eng.abort(ra)
    assert aborted.finish_reason == FinishReason.ABORT and eng.abort(12345) is None
    rest = []
    while eng.has_work():
        rest += eng.step()
    assert [c.request_id for c in rest] == [rb] and rest[0].output_ids == cold(b, GREEDY).output_ids
    first = rest[0].output_ids[2]
    stopped = eng.generate([b], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(first,)))[0]
    assert stopped.finish_reason == FinishReason.STOP and stopped.output_ids == rest[0].output_ids[:3]
    streamed = list(eng.stream(b, GREEDY))
    assert [t for t, _ in streamed] == rest[0].output_ids
    eng.check_invariants()


def test_truncated_sampling_reports_untruncated_logprobs():
    p = prompt(6, 11)
    top1 = engine().generate([p], SamplingParams(temperature=1.0, top_k=1, max_new_tokens=5, seed=0))[0]
    greedy = engine().generate([p], SamplingParams(temperature=0, max_new_tokens=5))[0]
    assert top1.output_ids == greedy.output_ids
    assert top1.logprobs == pytest.approx(greedy.logprobs, abs=1e-6) and max(top1.logprobs) < 0


def test_release_and_resume_memory():
    eng = engine()
    p = prompt(10, 12)
    first = eng.generate([p], GREEDY)[0]
    eng.release_memory()
    with pytest.raises(RuntimeError, match="released"):
        eng.submit(p, GREEDY) and eng.step()
    eng.waiting.clear()
    eng.resume_memory()
    assert eng.generate([p], GREEDY)[0].output_ids == first.output_ids


@pytest.mark.parametrize("overlap", ["off", "on"])
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), memory=st.sampled_from([360_000, 700_000, ROOMY]))
def test_fuzz_streams_with_shared_prefixes_aborts_and_pressure(overlap, seed, memory):
    rng = random.Random(seed)
    eng = engine(memory=memory, state_fraction=0.95, overlap=overlap)
    bases = [prompt(30, 100 + i) for i in range(3)]
    submitted = 0
    for _ in range(30):
        if submitted < 8 and rng.random() < 0.4:
            p = rng.choice(bases)[: rng.randrange(1, 30)] + prompt(rng.randrange(0, 6), rng.randrange(10**6))
            eng.submit(p, SamplingParams(temperature=rng.choice([0, 1.0]), max_new_tokens=rng.randrange(1, 8),
                                         seed=rng.randrange(100)))  # <= 43 tokens: fits 11 pages
            submitted += 1
        elif eng.running and rng.random() < 0.1:
            eng.abort(rng.choice(eng.running).req.request_id)
        eng.step()
        eng.check_invariants()
    for _ in range(2000):  # a livelock (requests retracting each other forever) fails instead of hanging
        if not eng.has_work():
            break
        eng.step()
        eng.check_invariants()
    assert not eng.has_work(), "engine made no progress"
    eng._evict_pages(10**9)
    eng._evict_checkpoints(10**9)
    assert eng.kv.allocator.num_free == eng.kv.allocator.capacity
    assert eng.states.allocator.num_free == eng.states.allocator.capacity


def test_grpo_group_shares_the_prompt_up_to_its_last_chunk_boundary():
    eng = engine(max_prefill_tokens=32)
    p = prompt(45, 20)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    first = eng.submit(p, params)
    while not any(r.req.output_ids for r in eng.running if r.req.request_id == first):
        eng.step()
    followers = [eng.submit(p, SamplingParams(temperature=1.0, max_new_tokens=4, seed=s)) for s in range(3)]
    done = {}
    while eng.has_work():
        done.update({c.request_id: c for c in eng.step()})
    assert [done[f].cached_tokens for f in followers] == [40, 40, 40]  # 45 tokens, chunk 8: boundary 40
    computed = sum(len(p) - done[i].cached_tokens for i in [first, *followers])
    assert computed <= (1 / 4 + 0.1) * 4 * len(p)


def test_overlapped_decode_gives_the_plain_schedule_outputs():
    """Overlap enqueues decode step k+1 from step k's device tokens before reading them: outputs, log-probs
    and finish reasons equal the plain schedule's, with stop tokens (a stopped request was fed one step
    more), length limits, admissions while decoding (max_running < requests), chunk-boundary snapshots
    during decode, and prefix hits afterwards. Pools return to full."""
    group = prompt(13, 40)
    prompts = [group] * 3 + [prompt(n, 41 + n) for n in (5, 9, 17)]
    greedy_ref = engine(overlap="off").generate([prompts[3]], SamplingParams(temperature=0, max_new_tokens=12))[0]
    stop = greedy_ref.output_ids[5]  # some requests stop early on it
    params = [SamplingParams(temperature=1.0, max_new_tokens=12 + i, seed=i, stop_token_ids=(stop,))
              for i in range(3)]
    params += [SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)),
               SamplingParams(temperature=0.7, top_k=50, max_new_tokens=20, seed=7),
               SamplingParams(temperature=0, max_new_tokens=1)]

    def run(overlap):
        eng = engine(overlap=overlap, max_running=4)
        ids = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
        done, launches = {}, 0
        while eng.has_work():
            done.update({c.request_id: c for c in eng.step()})
            launches += eng._inflight is not None
            eng.check_invariants()
        again = eng.generate(prompts, params)  # prefix hits on the tree the first round left
        assert sum(c.cached_tokens for c in again) > 0
        eng._evict_pages(10**9)
        eng._evict_checkpoints(10**9)
        assert eng.kv.allocator.num_free == eng.kv.allocator.capacity
        assert eng.states.allocator.num_free == eng.states.allocator.capacity
        return [done[i] for i in ids], again, launches

    plain, plain_again, none = run("off")
    over, over_again, launches = run("on")
    assert none == 0 and launches > 10  # the overlapped run kept a step in flight most of the time
    assert plain[3].finish_reason == FinishReason.STOP and plain[3].output_ids[-1] == stop
    for a, b in zip(plain + plain_again, over + over_again):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_group_submitted_together_computes_its_prompt_once(overlap):
    """GRPO submits n samples of a prompt at once: the first prefills, the others wait (in order) until
    it has donated the shared chunks, then restore there. Outputs equal cold runs; a prompt shorter than
    a chunk, or a different prompt, does not wait."""
    eng = engine(max_prefill_tokens=32, overlap=overlap)
    long_a, long_b, short = prompt(45, 30), prompt(30, 31), prompt(6, 32)
    prompts = [long_a] * 4 + [long_b] * 3 + [short] * 2
    params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=s) for s in range(len(prompts))]
    outs = eng.generate(prompts, params)
    assert [o.cached_tokens for o in outs] == [0, 40, 40, 40, 0, 24, 24, 0, 0]  # chunk 8: 44 -> 40, 29 -> 24
    for p, sp, o in zip(prompts, params, outs):
        assert o.output_ids == cold(p, sp).output_ids
    eng.check_invariants()
