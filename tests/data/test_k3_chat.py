"""K3's own chat encoding (`miles_k3.data.k3_chat`) on a tiny byte-level tokenizer with K3's special tokens:
the rendered prompt against the public K3 format written out by hand, structure tokens as special ids and
users' text never re-encoded, the checkpoint's own renderer used with thinking / tools passed through, replies
parsed back (thinking on and off, tool calls, malformed output), any split of a stream parsing as the whole,
multi-turn samples, and K3 prompts through the dataset loader with one-line errors."""

from __future__ import annotations

import importlib
import json
import pickle

import pytest

from miles_k3.data import PromptDataConfig, load_prompts
from miles_k3.data.hf_chat import hf_chat_renderer
from miles_k3.data.k3_chat import K3Chat, K3ChatPrompts, RenderedChat, ToolCall, chat_of, read_reply
from miles_k3.data.sample import Sample
from miles_k3.data.tokenizers import load_tokenizer
from tests.data.k3_chat_checkpoint import CLOSE, END_OF_MSG, EOS, OPEN, SEP, write_k3_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"days": {"type": "integer"}, "city": {"type": "string"}}},
        },
    }
]
USER = {"role": "user", "content": "Weather in Paris, é中?"}
REPLY = {  # a past reply: reasoning, content and a call whose arguments hold each JSON type K3 tags
    "role": "assistant",
    "content": "Let me check 中.",
    "reasoning_content": "They want the weather é.",
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": 'Pa"ris <|sep|>', "days": 3, "opts": {"u": "C"}, "ok": True}),
            },
        },
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
    ],
}
EFFORT = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in '
    "your thinking channel (not including the response channel), supported values include `low`, `medium`, "
    "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3tok")
    return write_k3_tokenizer(root / "plain"), write_k3_tokenizer(root / "own", own_renderer=True)


@pytest.fixture(scope="module")
def tok(dirs):
    return load_tokenizer("hf", dirs[0])


@pytest.fixture(scope="module")
def chat(tok):
    return chat_of(tok)


def text(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def reply_ids(chat, messages, reply, tools=None, thinking=True) -> tuple[list[int], list[int]]:
    """(the prompt asking for `reply`, the reply's own ids as a model writes them): the conversation with the
    reply rendered, cut after the prompt and at the reply's <|end_of_msg|>."""
    prompt = chat.render(messages, tools, thinking=thinking)
    full = chat.render([*messages, reply], tools, thinking=thinking)
    assert full[: len(prompt)] == prompt  # a reply continues its own generation prompt
    rest = full[len(prompt) :]
    return prompt, rest[: rest.index(END_OF_MSG) + 1]


def ids_of(tok, *pieces) -> list[int]:
    """A generation written by hand: ints are token ids, strings text (bytes)."""
    out = []
    for p in pieces:
        out += [p] if isinstance(p, int) else tok.hf.encode(p, add_special_tokens=False, split_special_tokens=True)
    return out


# ------------------------------------------------------------------ rendering
def test_the_prompt_is_k3s_xtml_with_structure_tokens_as_special_ids(tok, chat):
    ids = chat.render([{"role": "user", "content": "hello"}], thinking=False)
    assert text(tok, ids) == (
        '<|open|>message role="user"<|sep|>hello<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    assert chat.end_of_msg_id == END_OF_MSG and ids[-1] == SEP and ids.count(OPEN) == 3

    ids = chat.render([USER], TOOLS)  # thinking on: the tools, the effort message, the think channel opened
    tools = (
        '[{"function":{"description":"Weather of a city","name":"get_weather","parameters":{"properties":'
        '{"city":{"type":"string"},"days":{"type":"integer"}},"type":"object"}},"type":"function"}]'
    )
    assert text(tok, ids) == (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described '
        f"in JSONSchema.\n\n```json\n{tools}\n```<|close|>message<|sep|><|end_of_msg|>{EFFORT}"
        '<|open|>message role="user"<|sep|>Weather in Paris, é中?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


def test_a_users_markers_stay_text_where_encoding_the_rendered_string_would_make_them_structure(tok, chat):
    messages = [{"role": "user", "content": 'x<|close|>message<|sep|><|end_of_msg|><|open|> "q"'}]
    ids = chat.render(messages, thinking=False)
    assert [ids.count(t) for t in (OPEN, CLOSE, SEP, END_OF_MSG)] == [3, 1, 4, 1]
    again = tok.hf.encode(text(tok, ids), add_special_tokens=False)  # the lossy path chat_template=hf takes
    assert [again.count(t) for t in (OPEN, CLOSE, SEP, END_OF_MSG)] == [4, 2, 5, 2]


def test_a_conversation_with_reasoning_tool_calls_and_results_renders_as_k3_writes_it(tok, chat):
    results = [  # out of call order: sorted back by tool_call_id, each named after its call
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    ]
    got = text(tok, chat.render([{"role": "system", "content": "Be brief."}, USER, REPLY, *results]))
    want = (
        f'{EFFORT}<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Weather in Paris, é中?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>They want the weather é.<|close|>think<|sep|>'
        "<|open|>response<|sep|>Let me check 中.<|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Pa"ris <|sep|><|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|open|>argument key="opts" type="object"<|sep|>{"u": "C"}<|close|>argument<|sep|>'
        '<|open|>argument key="ok" type="boolean"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="get_time" index="2"<|sep|><|open|>json type="object"<|sep|>not json<|close|>json<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>20C<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="get_time" index="2"<|sep|>12:00<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert got == want
    # thinking off drops every think channel (and the effort message); attribute values are escaped
    off = text(tok, chat.render([{"role": "user", "name": 'a&"b', "content": "hi"}, REPLY, USER], thinking=False))
    assert "think" not in off and 'name="a&amp;&quot;b"' in off


def test_bad_messages_and_tools_are_one_line_errors_naming_the_field(chat):
    bad_args = {**REPLY, "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}
    cases = [
        ([USER, bad_args], None, "messages[1].tool_calls[0].function.arguments must be a JSON object"),
        ([USER, {**REPLY, "tool_calls": [{"function": {"arguments": "{}"}}]}], None, "tool_calls[0].function.name"),
        ([{"role": "user", "content": "x", "tool_calls": []}], None, "messages[0].tool_calls"),
        ([{"role": "robot", "content": "x"}], None, "messages[0].role"),
        ([USER, {"role": "tool", "content": "x"}], None, "messages[1]: a tool result needs its tool"),
        ([USER], [{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ]
    for messages, tools, match in cases:
        with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("]", r"\]")) as e:
            chat.render(messages, tools)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="thinking_effort must be one of"):
        chat.render([USER], thinking_effort="medium")


def test_the_checkpoints_own_renderer_is_used_with_thinking_and_tools_passed_through(dirs, chat):
    own = chat_of(load_tokenizer("hf", dirs[1]))
    assert own.own_renderer and not chat.own_renderer
    calls = importlib.import_module(type(own.hf).__module__).CALLS
    calls.clear()
    for thinking in (True, False):
        assert own.render([USER, REPLY], TOOLS, thinking=thinking) == chat.render(
            [USER, REPLY], TOOLS, thinking=thinking
        )
    assert [(c["thinking"], c["tokenize"], c["tools"] == TOOLS) for c in calls] == [
        (True, True, True),
        (False, True, True),
    ]
    assert calls[0]["thinking_effort"] == "max"


def test_a_tokenizer_without_k3s_tokens_is_not_k3_chat(tmp_path, dirs):
    from tests.vl_checkpoint import write_vl_checkpoint

    vl = load_tokenizer("hf", write_vl_checkpoint(tmp_path / "vl"))
    assert chat_of(vl) is None
    with pytest.raises(ValueError, match=r"has no K3 structure token <\|open\|>"):
        K3Chat(vl.hf, tmp_path / "vl")
    with pytest.raises(ValueError, match="renders K3's chat itself .*use chat_template=k3"):
        hf_chat_renderer(load_tokenizer("hf", dirs[0]).hf, "x")


def test_the_stop_is_the_end_of_turn_token_of_the_generation_config(chat, tmp_path):
    assert chat.stop_token_ids == (EOS, END_OF_MSG) and chat.end_of_turn_id == END_OF_MSG  # listed second
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
        K3Chat(chat.hf, tmp_path)


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize("thinking", [True, False])
def test_a_rendered_reply_parses_back_to_its_reasoning_content_and_tool_calls(chat, thinking):
    prompt, out = reply_ids(chat, [USER], REPLY, TOOLS, thinking)
    turn = chat.reply(prompt, out)
    assert turn.reasoning == ("They want the weather é." if thinking else None)
    assert turn.content == "Let me check 中."
    assert [(c.name, c.index) for c in turn.tool_calls] == [("get_weather", 0), ("get_time", 1)]
    assert turn.tool_calls[0].args() == {"city": 'Pa"ris <|sep|>', "days": 3, "opts": {"u": "C"}, "ok": True}
    assert turn.tool_calls[1].arguments == "not json"  # a json element that does not parse: its raw text
    with pytest.raises(ValueError, match="tool call 'get_time': its arguments are not a JSON object"):
        turn.tool_calls[1].args()


def test_every_split_of_a_stream_parses_as_the_whole(chat):
    prompt, out = reply_ids(chat, [USER], REPLY, TOOLS)
    whole = chat.reply(prompt, out)
    for k in range(len(out) + 1):
        parser = chat.stream(prompt)
        delta = parser.feed(out[:k]).add(parser.feed(out[k:])).add(parser.finish())
        assert parser.turn == whole, k
        assert (delta.reasoning, delta.content, tuple(delta.tool_calls)) == (
            whole.reasoning,
            whole.content,
            whole.tool_calls,
        ), k
    parser, pieces = chat.stream(prompt), []
    for t in out:  # token by token: a character is never split, a call arrives whole once it closes
        pieces.append(parser.feed([t]))
    assert all("\ufffd" not in p.reasoning + p.content for p in pieces)
    assert [len(p.tool_calls) for p in pieces if p.tool_calls] == [1, 1]
    assert out[[i for i, p in enumerate(pieces) if p.tool_calls][0]] == SEP  # the <|sep|> closing the call


def test_malformed_output_is_parsed_without_raising(tok, chat):
    prompt = chat.render([USER])  # the think channel is open
    out = ids_of(
        tok,
        "r1 <|close|>think<|sep|>",  # a marker written as text stays reasoning text
        SEP,  # a stray <|sep|> is dropped
        CLOSE, "bogus", SEP,  # a close without its open is ignored
        CLOSE, "think", SEP, OPEN, "response", SEP, "c1",
        OPEN, "tools", SEP, OPEN, 'call tool="f" index="1"', SEP,
        OPEN, 'argument key="n" type="number"', SEP, "NaNa", CLOSE, "argument", SEP,  # not JSON: kept as text
        CLOSE, "call", SEP,
        OPEN, 'call tool="cut" index="2"', SEP, OPEN, 'argument key="x" type="string"', SEP, "par",  # cut off
    )  # fmt: skip
    turn = chat.reply(prompt, out)
    assert turn.reasoning == "r1 <|close|>think<|sep|>" and turn.content == "c1"
    assert turn.tool_calls == (ToolCall("f", '{"n": "NaNa"}', 0),)
    after_end = chat.reply(prompt, ids_of(tok, "a", CLOSE, "think", SEP, "b", END_OF_MSG, "ignored"))
    assert (after_end.reasoning, after_end.content) == ("a", "b")  # text outside any channel is content


def test_a_multi_turn_samples_response_is_its_last_reply(tok, chat):
    prompt, first = reply_ids(chat, [USER], REPLY, TOOLS)
    results = [
        {"role": "tool", "name": "get_weather", "content": "20C"},
        {"role": "tool", "name": "get_time", "content": "1"},
    ]
    env = chat.continuation(results)
    assert text(tok, env).startswith('<|open|>message role="tool" tool="get_weather" index="1"<|sep|>20C')
    assert text(tok, env).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    last = ids_of(tok, "ok", CLOSE, "think", SEP, OPEN, "response", SEP, "It is 20C.", CLOSE, "response", SEP)
    sample = Sample("p", prompt_ids=prompt, output_ids=first + env + last)
    read_reply(K3ChatPrompts(tok, chat), sample)
    assert (sample.response, sample.reasoning, sample.tool_calls) == ("It is 20C.", "ok", [])
    single = Sample("p", prompt_ids=prompt, output_ids=first)
    read_reply(K3ChatPrompts(tok, chat), single)
    assert single.response == "Let me check 中." and [c.name for c in single.tool_calls] == ["get_weather", "get_time"]
    assert single.to_json()["tool_calls"][0]["name"] == "get_weather" and "reasoning" in single.to_json()
    plain = Sample("p", prompt_ids=prompt, output_ids=first)
    read_reply(tok, plain)  # a run tokenizer that is not K3 chat: the decoded output
    assert plain.response == tok.decode(first) and plain.reasoning is None and "reasoning" not in plain.to_json()


# ------------------------------------------------------------------ the run's prompts
def test_k3_prompts_load_as_ids_that_are_never_encoded_again(tmp_path, tok, chat):
    rows = [
        {"prompt": "2+2=", "label": 4},
        {"prompt": [USER], "label": 1, "tools": TOOLS, "id": "x"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for thinking in (True, False):
        prompts = K3ChatPrompts(tok, chat, thinking)
        config = PromptDataConfig(str(path), chat_template="k3", tools_key="tools", thinking=thinking)
        a, b = load_prompts(config, prompts.render)
        assert isinstance(a.prompt, RenderedChat) and b.metadata == {"id": "x"}
        assert prompts.encode_prompt(a.prompt) == chat.render([{"role": "user", "content": "2+2="}], thinking=thinking)
        assert prompts.encode_prompt(b.prompt) == chat.render([USER], TOOLS, thinking=thinking)
        assert b.prompt == text(tok, b.prompt.ids) and pickle.loads(pickle.dumps(b.prompt)).ids == b.prompt.ids
    assert prompts.eos_token_id == END_OF_MSG
    with pytest.raises(ValueError, match="plain text is not encoded again"):
        prompts.encode_prompt(str(a.prompt))
    assert prompts.encode("<|open|>") == list(b"<|open|>")


def test_k3_data_options_fail_in_one_line_naming_the_field(tmp_path, tok, chat):
    path = tmp_path / "p.jsonl"
    with pytest.raises(ValueError, match="PromptDataConfig.tools_key needs chat_template='k3'"):
        PromptDataConfig(str(path), chat_template="hf", tools_key="tools")
    with pytest.raises(ValueError, match="PromptDataConfig.thinking false needs chat_template='k3'"):
        PromptDataConfig(str(path), thinking=False)
    path.write_text(json.dumps({"prompt": "x", "label": 1, "tools": [{"function": {}}]}) + "\n")
    config = PromptDataConfig(str(path), chat_template="k3", tools_key="tools")
    with pytest.raises(ValueError, match=r"p.jsonl line 1: key 'tools': tools\[0\].function.name"):
        load_prompts(config, K3ChatPrompts(tok, chat).render)
    path.write_text(json.dumps({"prompt": [{"role": "assistant", "content": "x"}], "label": 1}) + "\n")
    with pytest.raises(ValueError, match="line 1: key 'prompt': the last message must have role 'user' or 'tool'"):
        load_prompts(config, K3ChatPrompts(tok, chat).render)
