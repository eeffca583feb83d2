"""The official `openai` package against a live server: completions, chat, streaming, log-probs, n, seeds,
the adapter by model name, models, errors. Greedy answers equal the in-process engine's."""

from __future__ import annotations

import asyncio

import openai
import pytest

from rollout.request import SamplingParams
from tests.server.common import ADAPTER, MODEL

PROMPTS = ["12+3=", "7-9=", "45+45="]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(reference, text: str, max_new: int, adapter: str | None = None):
    """The in-process engine's greedy completion of `text` (stopping at eos, as the server does)."""
    tok = reference.tokenizer
    params = SamplingParams(temperature=0, max_new_tokens=max_new, stop_token_ids=(tok.eos_token_id,))
    out = reference.engine.generate([tok.encode(text)], params, adapter=adapter)[0]
    return out, tok.decode(out.output_ids)


def test_models_list_the_base_and_each_adapter(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, ADAPTER]


def test_greedy_completion_and_logprobs_equal_the_in_process_engine(client, reference):
    for text in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, logprobs=0)
        want, want_text = greedy(reference, text, 6)
        choice = r.choices[0]
        assert choice.text == want_text
        assert choice.finish_reason == ("stop" if want.finish_reason.value == "stop" else "length")
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert len(choice.logprobs.tokens) == len(want.output_ids)
        assert r.usage.prompt_tokens == len(reference.tokenizer.encode(text))
        assert r.usage.completion_tokens == len(want.output_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_goes_through_the_template_and_streams_the_same_text(client, reference):
    messages = [{"role": "user", "content": "12+3="}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    want_ids = reference.tokenizer.encode_chat(messages)
    assert r.usage.prompt_tokens == len(want_ids)
    _, want_text = greedy(reference, "12+3=", 6)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want_text
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_streamed_completion_logprobs_match_the_whole_answer(client):
    kw = dict(model=MODEL, prompt="45+45=", max_tokens=8, temperature=0, logprobs=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)


def test_n_samples_and_seeds_reproduce(client):
    kw = dict(model=MODEL, prompt="3+4=", max_tokens=6, temperature=1.0, n=4, seed=123)
    a = [c.text for c in client.completions.create(**kw).choices]
    b = [c.text for c in client.completions.create(**kw).choices]
    assert len(a) == 4 and a == b
    assert [c.index for c in client.completions.create(**kw).choices] == [0, 1, 2, 3]
    assert len(set(a)) > 1  # sample i draws from seed + i: the n samples differ
    other = [c.text for c in client.completions.create(**{**kw, "seed": 7}).choices]
    assert other != a


def test_the_adapter_is_selected_by_model_name(client, reference):
    texts = {}
    for model, adapter in ((MODEL, None), (ADAPTER, ADAPTER)):
        r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=6, temperature=0, logprobs=0)
        texts[model] = [c.text for c in r.choices]
        for text, choice in zip(PROMPTS, r.choices):
            want, want_text = greedy(reference, text, 6, adapter)
            assert choice.text == want_text
            assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert texts[MODEL] != texts[ADAPTER]


def test_stop_strings_cut_the_text(client):
    full = (
        client.completions.create(
            model=MODEL, prompt="12+3=", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[2:4]
    cut = client.completions.create(
        model=MODEL, prompt="12+3=", max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    # streamed, the stop string's first character is held back until the second one completes the match
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="12+3=",
            max_tokens=8,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_async_client_requests_batch_together(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(
            *[
                client.completions.create(model=MODEL, prompt=f"{i}+{i}=", max_tokens=4, temperature=0)
                for i in range(12)
            ]
        )
        await client.close()
        return rs

    rs = asyncio.run(main())
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in rs)


def test_errors_arrive_as_the_client_s_exceptions(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-nothing", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+1="}], max_tokens=10**6)
