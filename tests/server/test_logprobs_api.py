"""Top log-probs through the APIs, against the model's own distribution: the official `openai` client with
completions `logprobs=5` and chat `top_logprobs=3`, streamed and not, and SGLang's /generate with
`top_logprobs_num`, `token_ids_logprob` and `logprob_start_len` over httpx. The reference is the log-softmax of
the served model's logits over the same ids at the request's temperature, fp32 on CPU, to 1e-5; the sampled
ids come from the in-process twin engine with the same seed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from miles_k3.model.cache import DenseStateCache
from rollout.request import SamplingParams
from tests.server.common import MODEL

TEMPERATURE, SEED = 0.8, 11
IDS = [3, 5, 9]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def model_logprobs(reference, ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the served model at every position of `ids`, fp32 on CPU [len, V]."""
    model, pool = reference.engine.model, reference.engine.adapters
    if pool is not None:  # the base: every token on slot 0
        pool.set_batch([0], len(ids))
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), DenseStateCache(model.config)).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def sampled(reference, prompt_ids: list[int], max_new: int) -> list[int]:
    """The ids the server draws for this request: the twin engine with the same seed and stop token."""
    tok = reference.tokenizer
    params = SamplingParams(
        temperature=TEMPERATURE, max_new_tokens=max_new, seed=SEED, stop_token_ids=(tok.eos_token_id,)
    )
    return reference.engine.generate([prompt_ids], params)[0].output_ids


def expected(reference, prompt_ids: list[int], out: list[int], n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per output token: (its log-prob, the top n (id, log-prob)) under the model's distribution."""
    ref = model_logprobs(reference, prompt_ids + out, TEMPERATURE)
    rows = []
    for i, t in enumerate(out):
        row = ref[len(prompt_ids) + i - 1]
        top = row.topk(n)
        rows.append((row[t].item(), list(zip(top.indices.tolist(), top.values.tolist()))))
    return rows


def test_completions_logprobs_5_are_the_models_top_alternatives_streamed_or_not(client, reference):
    text = reference.tokenizer.token_text
    prompt = "12+7="
    ids = reference.tokenizer.encode(prompt)
    out = sampled(reference, ids, 8)
    want = expected(reference, ids, out, 5)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=TEMPERATURE, seed=SEED, logprobs=5)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    for lp in (whole, streamed):
        tokens = lp.tokens if lp is whole else [t for c in lp for t in c.tokens]
        values = lp.token_logprobs if lp is whole else [v for c in lp for v in c.token_logprobs]
        tops = lp.top_logprobs if lp is whole else [d for c in lp for d in c.top_logprobs]
        assert tokens == [text(t) for t in out]
        assert values == pytest.approx([w for w, _ in want], abs=1e-5)
        for got, (_, top) in zip(tops, want):
            assert got == pytest.approx({text(t): v for t, v in top}, abs=1e-5)


def test_chat_top_logprobs_3_are_the_models_top_alternatives_streamed_or_not(client, reference):
    text = reference.tokenizer.token_text
    messages = [{"role": "user", "content": "45+45="}]
    ids = reference.tokenizer.encode_chat(messages)
    out = sampled(reference, ids, 6)
    want = expected(reference, ids, out, 3)
    kw = dict(
        model=MODEL, messages=messages, max_tokens=6, temperature=TEMPERATURE, seed=SEED, logprobs=True, top_logprobs=3
    )
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    for content in (whole, streamed):
        assert [e.token for e in content] == [text(t) for t in out]
        for e, (value, top) in zip(content, want):
            assert e.logprob == pytest.approx(value, abs=1e-5)
            assert [a.token for a in e.top_logprobs] == [text(t) for t, _ in top]
            assert [a.logprob for a in e.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-5)


def test_generate_top_logprobs_token_ids_and_prompt_logprobs_are_the_models_streamed_or_not(http, reference):
    ids = reference.tokenizer.encode("45+45=")
    out = sampled(reference, ids, 6)
    ref = model_logprobs(reference, ids + out, TEMPERATURE)
    start = 2
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "top_logprobs_num": 4,
        "token_ids_logprob": IDS,
        "logprob_start_len": start,
        "sampling_params": {"temperature": TEMPERATURE, "max_new_tokens": 6, "sampling_seed": SEED},
    }
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    for answer in (whole, last):
        assert answer["output_ids"] == out
        meta = answer["meta_info"]
        n = len(ids)
        # SGLang's layout: the input lists cover positions start.. with a null log-prob at start
        assert [e[1] for e in meta["input_token_logprobs"]] == ids[start:]
        assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
        assert meta["input_token_ids_logprobs"][0] is None
        rows = [(ref[q - 1], ids[q]) for q in range(start + 1, n)] + [(ref[n + i - 1], t) for i, t in enumerate(out)]
        lps = [e[0] for e in meta["input_token_logprobs"][1:]] + [e[0] for e in meta["output_token_logprobs"]]
        tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
        given = meta["input_token_ids_logprobs"][1:] + meta["output_token_ids_logprobs"]
        assert len(lps) == len(tops) == len(given) == len(rows)
        for (row, t), lp, top, of_ids in zip(rows, lps, tops, given):
            assert lp == pytest.approx(row[t].item(), abs=1e-5)
            want = row.topk(4)
            assert [e[1] for e in top] == want.indices.tolist()
            assert [e[0] for e in top] == pytest.approx(want.values.tolist(), abs=1e-5)
            assert [e[1] for e in of_ids] == IDS
            assert [e[0] for e in of_ids] == pytest.approx(row[IDS].tolist(), abs=1e-5)
    # default logprob_start_len (-1): the prompt's last token only, with a null log-prob, as SGLang answers
    plain = http.post("/generate", json={"input_ids": ids, "return_logprob": True}).json()["meta_info"]
    assert plain["input_token_logprobs"] == [[None, ids[-1], None]] and "output_top_logprobs" not in plain
