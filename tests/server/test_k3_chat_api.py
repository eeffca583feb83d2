"""K3's chat encoding through `miles-serve`, on a random-init k3-tiny carrying a tiny tokenizer with K3's special
tokens (`tests/data/k3_chat_checkpoint.py`): the engine round trip (render -> generate -> parse, thinking on and
off), the official `openai` client against a live server (the message's reasoning_content / content /
tool_calls equal the in-process engine's greedy reply parsed, streamed or whole), a known reply's ids through
the server's own streaming path read back by the openai package's stream accumulator, and K3 request errors."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage

from miles_k3.data.media import IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, prompt_encoder
from rollout.request import SamplingParams
from rollout.server.generation import Delta
from rollout.server.openai_api import _chat_chunks, _k3_fields
from rollout.server.tokenization import K3ServerTokenizer
from tests.data.k3_chat_checkpoint import END_OF_MSG, IDS, write_k3_chat_checkpoint
from tests.data.test_k3_chat import REPLY, TOOLS, USER, reply_ids
from tests.server.common import config, serve, twin

NEW = 24  # tokens a test reply may take


@pytest.fixture(scope="module")
def k3_cfg(tmp_path_factory):
    path = write_k3_chat_checkpoint(tmp_path_factory.mktemp("k3chat") / "ckpt")
    return config(model=str(path), tokenizer="hf", max_seq_len=2048, memory_mb=64.0)


@pytest.fixture(scope="module")
def k3_server(k3_cfg):
    s = serve(k3_cfg)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def k3_ref(k3_cfg):
    return twin(k3_cfg)


@pytest.fixture(scope="module")
def client(k3_server):
    return openai.OpenAI(base_url=f"{k3_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(ref, ids: list[int], new: int = NEW):
    """The in-process engine's greedy reply to `ids`, stopping at the end-of-turn token as the server does."""
    params = SamplingParams(temperature=0, max_new_tokens=new, stop_token_ids=(ref.tokenizer.eos_token_id,))
    return ref.engine.generate([ids], params)[0]


@pytest.mark.parametrize("thinking", [True, False])
def test_render_generate_parse_round_trip_through_the_engine(k3_ref, thinking):
    tok = k3_ref.tokenizer
    assert isinstance(tok, K3ServerTokenizer) and tok.eos_token_id == END_OF_MSG  # not the tokenizer's [EOS]
    chat = tok.chat
    ids = chat.render([USER], TOOLS, thinking=thinking)
    tail = "<|open|>think<|sep|>" if thinking else "<|open|>response<|sep|>"
    assert tok.decode(ids, skip_special_tokens=False).endswith('<|open|>message role="assistant"<|sep|>' + tail)
    out = greedy(k3_ref, ids).output_ids
    assert out and (out[-1] == END_OF_MSG or len(out) == NEW) and END_OF_MSG not in out[:-1]
    whole = chat.reply(ids, out)
    assert (whole.reasoning is not None) == thinking
    for k in range(len(out) + 1):
        parser = chat.stream(ids)
        parser.feed(out[:k])
        parser.feed(out[k:])
        parser.finish()
        assert parser.turn == whole


@pytest.mark.parametrize("thinking", [True, False])
def test_the_openai_client_reads_the_replys_fields_as_the_engine_parses_them(client, k3_ref, k3_cfg, thinking):
    chat = k3_ref.tokenizer.chat
    ids = chat.render([USER], TOOLS, thinking=thinking)
    want = chat.reply(ids, greedy(k3_ref, ids).output_ids)
    kw = dict(
        model=k3_cfg.model_name,
        messages=[USER],
        tools=TOOLS,
        max_tokens=NEW,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": thinking}},
    )
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(ids)  # the prompt is K3's rendering, as ids
    m = r.choices[0].message
    assert m.role == "assistant" and (m.model_extra or {}).get("reasoning_content") == want.reasoning
    assert m.content == (want.content if want.content or not want.tool_calls else None)
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls or []] == [
        (c.name, c.arguments) for c in want.tool_calls
    ]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    got = state.current_completion_snapshot.choices[0]  # (the final completion refuses a reply cut by length)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "") for c in chunks)
    assert (got.message.content or "", reasoning) == (want.content, want.reasoning or "")
    assert got.finish_reason == r.choices[0].finish_reason


class Scripted:
    """A generation whose deltas are given (a known reply's ids in pieces), for the server's streaming path."""

    def __init__(self, prompt: list[int], pieces: list[list[int]]):
        self.states = [SimpleNamespace(req=SimpleNamespace(prompt_ids=prompt), sample=SimpleNamespace(shutdown=False))]
        self.pieces = pieces

    async def __aiter__(self):
        for i, ids in enumerate(self.pieces):
            yield Delta(0, "", ids, [0.0] * len(ids), "stop" if i == len(self.pieces) - 1 else None)


def stream_chunks(ctx, prompt, out, size: int) -> list[ChatCompletionChunk]:
    async def run():
        gen = Scripted(prompt, [out[i : i + size] for i in range(0, len(out), size)])
        meta = {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "m"}
        return [e async for e in _chat_chunks(ctx, gen, meta, False, False)]

    events = [e.decode().removeprefix("data: ").strip() for e in asyncio.run(run())]
    assert events[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_known_reply_streams_as_openai_deltas_with_reasoning_content_and_tool_calls(k3_ref, size):
    chat = k3_ref.tokenizer.chat
    ctx = SimpleNamespace(tokenizer=k3_ref.tokenizer)
    prompt, out = reply_ids(chat, [USER], REPLY, TOOLS)
    chunks = stream_chunks(ctx, prompt, out, size)
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check 中."
    assert [(c.id.startswith("call_"), c.function.name) for c in final.message.tool_calls] == [
        (True, "get_weather"),
        (True, "get_time"),
    ]
    assert json.loads(final.message.tool_calls[0].function.arguments)["city"] == 'Pa"ris <|sep|>'
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "") for c in chunks)
    assert reasoning == "They want the weather é."
    assert chunks[0].choices[0].delta.role == "assistant"
    with_calls = [c for c in chunks if c.choices[0].delta.tool_calls]
    assert [tc.index for c in with_calls for tc in c.choices[0].delta.tool_calls] == [0, 1]

    # the whole message of a reply that only calls tools: content null, as OpenAI writes it
    only_calls = {**REPLY, "content": ""}
    p, o = reply_ids(chat, [USER], only_calls, TOOLS, thinking=False)
    message = ChatCompletionMessage.model_validate({"role": "assistant", **_k3_fields(chat.reply(p, o), whole=True)})
    assert message.content is None and len(message.tool_calls) == 2 and "reasoning_content" not in message.model_extra


def test_a_multi_turn_request_with_tool_calls_and_results_renders_as_k3_and_errors_name_the_field(
    client, k3_ref, k3_cfg
):
    chat = k3_ref.tokenizer.chat
    messages = [
        USER,
        {**REPLY, "content": None},  # OpenAI's shape: a reply that only calls tools has content null
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    ]
    r = client.chat.completions.create(model=k3_cfg.model_name, messages=messages, tools=TOOLS, max_tokens=2)
    assert r.usage.prompt_tokens == len(chat.render(messages, TOOLS))
    bad = [
        (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
        (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
        (dict(extra_body={"chat_template_kwargs": {"thinking": "yes"}}), "chat_template_kwargs.thinking"),
        (
            dict(extra_body={"chat_template_kwargs": {"thinking_effort": "huge"}}),
            "chat_template_kwargs.thinking_effort",
        ),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=k3_cfg.model_name, messages=[USER], max_tokens=2, **kw)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        bad_call = {**REPLY, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}
        client.chat.completions.create(model=k3_cfg.model_name, messages=[USER, bad_call], max_tokens=2)
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_an_images_media_block_goes_in_as_special_tokens_not_text(k3_ref):
    """`prompt_encoder` (miles-k3 generate, /generate rows) expands an image placeholder to its media block
    before the chat encoding: the block's tokens stay special ids, its pad run the image's length."""
    image = SimpleNamespace(size=(28, 14), num_tokens=3)
    messages = [{"role": "user", "content": f"what is {IMAGE_PLACEHOLDER} here <|media_pad|>"}]
    encode = prompt_encoder(k3_ref.tokenizer, [image], IDS[MEDIA_PAD])
    ids = encode({"messages": messages})  # checks one pad run of 3 (a pad typed as text stays text)
    assert ids.count(IDS[MEDIA_PAD]) == 3 and ids.count(IDS[MEDIA_BEGIN]) == 1
    assert ids == k3_ref.tokenizer.chat.render(
        messages, image_prompts=[f"{MEDIA_BEGIN}image 28x14{MEDIA_CONTENT}{MEDIA_PAD * 3}{MEDIA_END}"]
    )
