"""Top log-probs, given ids' log-probs and prompt log-probs from the engine's one pass, against the reference
model's log-softmax over the same ids (fp32 on CPU): per output token, under every schedule (overlap, a
prefix-cache hit the prompt log-probs must not skip, a retraction), with the accounting intact."""

import pytest
import torch

from miles_k3.model.cache import DenseStateCache
from rollout.request import SamplingParams
from tests.rollout.common import MODEL, TIGHT, assert_pools_drain_to_full, drain, engine, prompt

IDS = (3, 17, 42)


def reference(ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the model at every position of `ids` (T = 1 when greedy) [len, V]."""
    with torch.inference_mode():
        logits = MODEL(torch.tensor([ids]), DenseStateCache(MODEL.config)).logits[0].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def check_output(c, params: SamplingParams) -> None:
    ref = reference(c.prompt_ids + c.output_ids, params.temperature)
    n = len(c.prompt_ids)
    assert len(c.top_logprobs) == len(c.output_ids) == len(c.token_ids_logprobs)
    for i, tok in enumerate(c.output_ids):
        row = ref[n + i - 1]
        assert c.logprobs[i] == pytest.approx(row[tok].item(), abs=1e-5)
        want = row.topk(params.top_logprobs)
        got_ids = [t for t, _ in c.top_logprobs[i]]
        assert got_ids == want.indices.tolist()
        assert [lp for _, lp in c.top_logprobs[i]] == pytest.approx(want.values.tolist(), abs=1e-5)
        assert c.token_ids_logprobs[i] == pytest.approx(row[list(IDS)].tolist(), abs=1e-5)
        if tok in got_ids:  # the sampled token's log-prob is the very number its top entry shows
            assert dict(c.top_logprobs[i])[tok] == c.logprobs[i]


def check_prompt(c, params: SamplingParams) -> None:
    ref = reference(c.prompt_ids, params.temperature)
    start = params.logprob_start_len
    lp = c.prompt
    assert lp.start == start and len(lp.logprobs) == len(c.prompt_ids) - start
    for j, value in enumerate(lp.logprobs):
        q = start + j
        if q == 0:
            assert value is None and lp.top[j] is None and lp.token_ids[j] is None
            continue
        row = ref[q - 1]
        assert value == pytest.approx(row[c.prompt_ids[q]].item(), abs=1e-5)
        assert [t for t, _ in lp.top[j]] == row.topk(params.top_logprobs).indices.tolist()
        assert [v for _, v in lp.top[j]] == pytest.approx(row.topk(params.top_logprobs).values.tolist(), abs=1e-5)
        assert lp.token_ids[j] == pytest.approx(row[list(IDS)].tolist(), abs=1e-5)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_top_logprobs_ids_and_prompt_logprobs_are_the_models_distribution(overlap):
    eng = engine(overlap=overlap)
    prompts = [prompt(n, i) for i, n in enumerate([1, 9, 20])]
    cases = [
        SamplingParams(temperature=0.7, max_new_tokens=6, seed=1, top_logprobs=5, token_ids_logprob=IDS),
        SamplingParams(temperature=0, max_new_tokens=6, top_logprobs=4, token_ids_logprob=IDS, logprob_start_len=0),
        SamplingParams(
            temperature=1.3,
            top_k=3,
            max_new_tokens=6,
            seed=2,
            top_logprobs=3,
            token_ids_logprob=IDS,
            logprob_start_len=5,
        ),
    ]
    plain = SamplingParams(temperature=0, max_new_tokens=6)
    outs = eng.generate(prompts + [prompts[1]], cases + [plain])
    for c, params in zip(outs, cases):
        check_output(c, params)
        if params.logprob_start_len >= 0:
            check_prompt(c, params)
        else:
            assert c.prompt is None
    assert outs[3].top_logprobs is None and outs[3].token_ids_logprobs is None and outs[3].prompt is None
    assert outs[3].output_ids == outs[1].output_ids  # asking for alternatives changes no draw
    assert_pools_drain_to_full(eng)


def test_prompt_logprobs_are_not_skipped_by_a_prefix_cache_hit():
    eng = engine()
    p = prompt(30, 7)
    eng.generate([p], SamplingParams(temperature=0, max_new_tokens=2))
    hit = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=2))[0]
    assert hit.cached_tokens > 8  # the cache holds the prompt's chunks
    for start in (hit.cached_tokens - 1, hit.cached_tokens + 2):
        params = SamplingParams(
            temperature=0, max_new_tokens=3, top_logprobs=2, token_ids_logprob=IDS, logprob_start_len=start
        )
        c = eng.generate([p], params)[0]
        assert c.cached_tokens <= start - 1  # the hit stops before the row position `start` needs
        if start > hit.cached_tokens:
            assert c.cached_tokens == hit.cached_tokens  # a hit before that row is still taken
        check_prompt(c, params)
        check_output(c, params)
        eng.check_invariants()
    assert_pools_drain_to_full(eng)


def test_alternatives_survive_retraction_and_streaming():
    eng = engine(**TIGHT)
    params = SamplingParams(
        temperature=0.9, max_new_tokens=10, seed=5, top_logprobs=3, token_ids_logprob=IDS, logprob_start_len=1
    )
    ids = [eng.submit(prompt(14, 20 + i), params, stream=True) for i in range(3)]
    events = {i: [] for i in ids}
    done = {}
    while eng.has_work():
        for c in eng.step():
            done[c.request_id] = c
        for i in ids:
            events[i] += eng.take_events(i)
        eng.check_invariants()
    assert eng.counters()["retractions"] > 0
    for i in ids:
        c = done[i]
        check_output(c, params)
        check_prompt(c, params)
        assert [e.token for e in events[i]] == c.output_ids
        assert [e.top for e in events[i]] == c.top_logprobs and [e.ids for e in events[i]] == c.token_ids_logprobs
        assert events[i][0].prompt == c.prompt and all(e.prompt is None for e in events[i][1:])
    assert_pools_drain_to_full(eng)


def test_bad_alternative_requests_are_refused_at_submit():
    eng = engine()
    for params, match in [
        (SamplingParams(top_logprobs=10**6), "top_logprobs"),
        (SamplingParams(token_ids_logprob=(10**6,)), "token_ids_logprob"),
        (SamplingParams(logprob_start_len=5), "logprob_start_len"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.submit(prompt(5, 1), params)
    for kwargs, field in [
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"token_ids_logprob": [1.5]}, "token_ids_logprob"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
    ]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**kwargs)
    assert not eng.has_work()
    drain(eng)
