"""The engine's API against the reference model: greedy parity, bad requests, abort / stop / stream, sampling
log-probs, releasing memory, and a fuzzed request stream that must keep the accounting and finish."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_k3.model.generate import greedy_generate
from rollout.request import FinishReason, SamplingParams
from tests.rollout.common import GREEDY, MODEL, ROOMY, TIGHT, assert_pools_drain_to_full, cold, engine, prompt


def test_greedy_output_and_logprobs_equal_the_reference_model():
    prompts = [prompt(n, i) for i, n in enumerate([1, 7, 8, 9, 30, 41])]
    outs = engine().generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        want, want_lp = greedy_generate(MODEL, torch.tensor([p]), 10)
        assert out.output_ids == want[0].tolist()
        torch.testing.assert_close(torch.tensor(out.logprobs), want_lp[0], rtol=0, atol=1e-4)
        assert out.finish_reason == FinishReason.LENGTH


def test_bad_requests_are_rejected_without_disturbing_others():
    eng = engine()
    ok = eng.submit(prompt(5, 5), GREEDY)
    for bad, match in [([], "empty"), ([1, 999], "outside"), (prompt(250, 6), "max_seq_len")]:
        with pytest.raises(ValueError, match=match):
            eng.submit(bad, GREEDY)
    with pytest.raises(ValueError, match="KV pages"):
        engine(**TIGHT).submit(prompt(60, 6), GREEDY)
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


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_take_tokens_hands_over_a_streamed_request_in_order_then_forgets_it(overlap):
    eng = engine(overlap=overlap)
    streamed, plain = eng.submit(prompt(12, 8), GREEDY, stream=True), eng.submit(prompt(9, 9), GREEDY)
    taken, done = [], {}
    while eng.has_work():
        done.update({c.request_id: c for c in eng.step()})
        taken += eng.take_tokens(streamed)
        assert eng.take_tokens(plain) == []  # not submitted with stream=True: nothing is kept
    taken += eng.take_tokens(streamed)
    c = done[streamed]
    assert [t for t, _ in taken] == c.output_ids and [lp for _, lp in taken] == c.logprobs
    assert eng.take_tokens(streamed) == [] and not eng._events and not eng._ended  # forgotten once handed over
    aborted = eng.submit(prompt(5, 5), GREEDY, stream=True)
    eng.step()
    eng.abort(aborted)
    eng.take_tokens(aborted)
    assert not eng._events and not eng._ended


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
    assert eng.kv is None and eng.states is None
    with pytest.raises(RuntimeError, match="released"):
        eng.submit(p, GREEDY) and eng.step()
    eng.scheduler.waiting.clear()
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
            eng.submit(
                p,
                SamplingParams(
                    temperature=rng.choice([0, 1.0]), max_new_tokens=rng.randrange(1, 8), seed=rng.randrange(100)
                ),
            )  # <= 43 tokens: fits 11 pages
            submitted += 1
        elif eng.scheduler.running and rng.random() < 0.1:
            eng.abort(rng.choice(eng.scheduler.running).req.request_id)
        eng.step()
        eng.check_invariants()
    for _ in range(2000):  # a livelock (requests retracting each other forever) fails instead of hanging
        if not eng.has_work():
            break
        eng.step()
        eng.check_invariants()
    assert not eng.has_work(), "engine made no progress"
    assert_pools_drain_to_full(eng)
