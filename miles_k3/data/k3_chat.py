"""K3's own chat encoding (XTML): chat messages -> prompt ids, and a reply's ids -> reasoning, content, tool calls.

K3 ships no Jinja chat template. Its tokenizer (remote code) renders a conversation as XTML elements and
encodes it piece by piece: the structure tokens are special ids, everything else (tag names, attributes, the
users' and tools' text) ordinary text encoded on its own, so a `<|open|>` typed by a user can never become a
structure token. Encoding the rendered string again would lose that, so prompts here are ids from the start.

The format, as the public K3 serving code writes and reads it (the checkpoint's `encoding_k3.py` as vLLM
carries it, `vllm/tokenizers/encoding_k3.py`; vLLM's `vllm/reasoning/kimi_k3_reasoning_parser.py` and
`vllm/tool_parsers/kimi_k3_tool_parser.py`; SGLang's `python/sglang/srt/function_call/kimik3_detector.py`)::

    element   <|open|>TAG KEY="VALUE"...<|sep|> BODY <|close|>TAG<|sep|>    (values: & -> &amp;, " -> &quot;)
    message   <|open|>message role="user"<|sep|>text<|close|>message<|sep|><|end_of_msg|>
    preamble  system messages type="tool-declare" (the tools as JSON) and type="thinking-effort" (thinking on)
    reply     <|open|>message role="assistant"<|sep|>
                <|open|>think<|sep|>REASONING<|close|>think<|sep|>                      (thinking on only)
                <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
                <|open|>tools<|sep|>                                                    (tool calls only)
                  <|open|>call tool="NAME" index="1"<|sep|>
                    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
                    <|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>
                  <|close|>call<|sep|>
                <|close|>tools<|sep|>
              <|close|>message<|sep|><|end_of_msg|>
    tool      <|open|>message role="tool" tool="NAME" index="1"<|sep|>result<|close|>message<|sep|><|end_of_msg|>

The generation prompt opens the assistant message and its first channel (`think`, or `response` with thinking
off), so a reply starts inside it and ends at `<|end_of_msg|>`, the end-of-turn token (the checkpoint's
generation_config.json eos, distinct from the tokenizer's generic EOS). A string argument is its raw text,
any other type JSON; arguments that are not a JSON object render as one `json` element of raw text.

    chat = K3Chat(hf_tokenizer, "/ckpt")                       # ValueError unless it has K3's structure tokens
    ids = chat.render(messages, tools, thinking=True)          # the checkpoint's own renderer when it has one
    turn = chat.reply(ids, output_ids)                          # ChatTurn(reasoning, content, tool_calls)
    parser = chat.stream(ids); parser.feed(new_ids) ...         # ChatDelta per piece; the same turn at the end

`K3Chat.render` uses the checkpoint tokenizer's own `apply_chat_template` when it is K3's remote code (it
returns ids), else the renderer here (`chat_segments`, written from the public code above) on any tokenizer
that has K3's structure tokens. Parsing works on ids: structure tokens are found by id, so text that merely
looks like a marker stays text. A reply's tool call counts once its `<|close|>call<|sep|>` arrives; one cut
off (by the length limit) is not a call.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_k3.data.media import IMAGE_PLACEHOLDER, content_parts_text
from miles_k3.data.messages import PartsText, check_message
from miles_k3.data.tokenizers import Decoder, HFTokenizer

if TYPE_CHECKING:
    from miles_k3.data.sample import Sample

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
STRUCTURE_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)
THINKING_EFFORTS = ("low", "high", "max")  # what K3's encoder accepts; "max" is its default
TOOL_CHOICES = ("auto", "none", "required")
GENERATION_CONFIG = "generation_config.json"

# The bodies of K3's internal system messages: format constants the model was tuned on (K3's encoder).
_TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_ATTR = re.compile(r'(\w+)="([^"]*)"')


# ------------------------------------------------------------------ messages and tools
def check_chat_message(i: int, message: Any, parts: PartsText | None = content_parts_text) -> dict[str, Any]:
    """messages[i] as K3's encoder reads it: {role, content} checked by the shared validator
    (`miles_k3.data.messages.check_message`), plus what a K3 conversation carries: `name`, an assistant's
    `reasoning_content` (or `reasoning`) and `tool_calls` (OpenAI's shape; content may then be null), a tool
    result's `tool_call_id`. One-line ValueError "messages[i]..." naming the field."""
    where = f"messages[{i}]"
    if isinstance(message, dict) and message.get("content") is None and message.get("tool_calls"):
        message = {**message, "content": ""}
    out: dict[str, Any] = check_message(i, message, parts)
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    for key, value in (("name", message.get("name")), ("tool_call_id", message.get("tool_call_id"))):
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{where}.{key} must be a string, got {type(value).__name__}")
            out[key] = value
    if reasoning is not None:
        if out["role"] != "assistant" or not isinstance(reasoning, str):
            raise ValueError(f"{where}.reasoning_content must be a string on an assistant message")
        out["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls is not None:
        if out["role"] != "assistant" or not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list, on an assistant message")
        out["tool_calls"] = [_check_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return out


def check_chat_messages(messages: Any, parts: PartsText | None = content_parts_text) -> list[dict[str, Any]]:
    """A whole conversation by `check_chat_message`; ValueError "messages ..." when it is not a non-empty list."""
    if not isinstance(messages, list) or not messages:
        shown = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {shown}")
    return [check_chat_message(i, m, parts) for i, m in enumerate(messages)]


def _check_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"{where} must be an object with a function {{name, arguments}}")
    fn = call["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise ValueError(f"{where}.id must be a string")
    arguments = fn.get("arguments")
    _arguments(arguments, f"{where}.function.arguments")  # fails here, not when rendered
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _arguments(value: Any, where: str) -> dict[str, Any] | str:
    """A call's arguments as K3 renders them: a dict (one argument element per key), or text that is not JSON
    (one raw json element). ValueError for JSON that is not an object, or another type."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a JSON object string or an object, got {type(value).__name__}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if not isinstance(parsed, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(parsed).__name__}")
    return parsed


def check_tools(tools: Any, where: str = "tools") -> list[dict[str, Any]]:
    """The tools offered to the model, OpenAI's list of {"type": "function", "function": {"name", ...}};
    ValueError "tools[i]..." naming the entry."""
    if not isinstance(tools, list):
        raise ValueError(f"{where} must be a list of tools, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ValueError(f'{where}[{i}] must be {{"type": "function", "function": {{"name", ...}}}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}[{i}].function.name must be a non-empty string")
    return tools


# ------------------------------------------------------------------ rendering
@dataclass(frozen=True)
class Segment:
    """A piece of a rendered conversation: `special` pieces (the structure tokens, an image's media block) are
    encoded with special tokens; the rest is ordinary text, encoded on its own."""

    text: str
    special: bool = False


class _Writer:
    """Segments of one conversation, written element by element."""

    def __init__(self, image_prompts: Sequence[str] | None):
        self.out: list[Segment] = []
        self.images = None if image_prompts is None else list(image_prompts)
        self.used = 0

    def text(self, text: str) -> None:
        if text:
            self.out.append(Segment(text))

    def content(self, text: str) -> None:
        """Message text; with image prompts, each image placeholder becomes its image's media block."""
        if self.images is None or IMAGE_PLACEHOLDER not in text:
            self.text(text)
            return
        pieces = text.split(IMAGE_PLACEHOLDER)
        for k, piece in enumerate(pieces):
            self.text(piece)
            if k < len(pieces) - 1:
                if self.used == len(self.images):
                    raise ValueError(f"messages hold more image placeholders than the {len(self.images)} images")
                self.out.append(Segment(self.images[self.used], special=True))
                self.used += 1

    def open(self, tag: str, *attrs: tuple[str, Any]) -> None:
        self.out.append(Segment(OPEN, True))
        self.text(tag)
        for key, value in attrs:
            escaped = str(value).replace("&", "&amp;").replace('"', "&quot;")
            for piece in (f" {key}", '="', escaped, '"'):
                self.text(piece)
        self.out.append(Segment(SEP, True))

    def close(self, tag: str) -> None:
        self.out.append(Segment(CLOSE, True))
        self.text(tag)
        self.out.append(Segment(SEP, True))

    def message(self, attrs: list[tuple[str, Any]], body: str) -> None:
        self.open("message", *attrs)
        self.content(body)
        self.close("message")
        self.out.append(Segment(END_OF_MSG, True))


def _sorted(value: Any) -> Any:
    """Dict keys sorted at every depth (K3 renders tool schemas so)."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _in_call_order(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results sorted into its assistant's tool_calls order when every result's tool_call_id
    names one of those calls (K3's encoder does the same); a run it cannot match whole keeps its order."""
    out: list[dict[str, Any]] = []
    position: dict[str, int] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "tool":
            if m["role"] == "assistant":
                position = {}
                for k, c in enumerate(m.get("tool_calls") or ()):
                    if c.get("id") is not None:
                        position.setdefault(c["id"], k)
            out.append(m)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        run = messages[i:j]
        if all(r.get("tool_call_id") in position for r in run):
            run = sorted(run, key=lambda r: position[r["tool_call_id"]])
        out += run
        i = j
    return out


def chat_segments(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str = "max",
    tool_choice: str | None = None,
    image_prompts: Sequence[str] | None = None,
    preamble: bool = True,
) -> list[Segment]:
    """A checked conversation (`check_chat_messages`) as segments, ending with the generation prompt (the
    assistant message opened, then its think channel, or its response channel with `thinking` off).
    `preamble` False leaves out what opens a conversation (the tools' and thinking-effort system messages,
    the tool-choice message): a continuation after a finished reply (`K3Chat.continuation`). A developer
    message renders as a system message. ValueError for an unknown `thinking_effort` / `tool_choice`, a tool
    result whose tool cannot be named, or image placeholders that do not match `image_prompts`."""
    if thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort must be one of {THINKING_EFFORTS}, got {thinking_effort!r}")
    if tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice must be one of {TOOL_CHOICES}, got {tool_choice!r}")
    w = _Writer(image_prompts)
    if preamble and tools:
        w.message([("role", "system"), ("type", "tool-declare")], _TOOLS_BODY.format(tools=_compact(_sorted(tools))))
    if preamble and thinking:
        w.message([("role", "system"), ("type", "thinking-effort")], _EFFORT_BODY.format(effort=thinking_effort))
    calls: list[dict[str, Any]] = []
    results = 0
    for i, m in enumerate(_in_call_order(messages)):
        role = "system" if m["role"] == "developer" else m["role"]
        named = [("name", m["name"])] if m.get("name") else []
        if role in ("user", "system"):
            w.message([("role", role), *named], m["content"])
        elif role == "tool":
            results += 1
            name = m.get("name")
            if name is None and m.get("tool_call_id") is not None:
                name = next((c["function"]["name"] for c in calls if c.get("id") == m["tool_call_id"]), None)
            if name is None and results <= len(calls):
                name = calls[results - 1]["function"]["name"]
            if name is None:
                raise ValueError(
                    f"messages[{i}]: a tool result needs its tool: a name, a tool_call_id of the assistant's "
                    "tool_calls, or a call at its position"
                )
            w.message([("role", "tool"), ("tool", name), ("index", results)], m["content"])
        else:
            calls, results = list(m.get("tool_calls") or ()), 0
            w.open("message", ("role", "assistant"), *named)
            _assistant(w, m, thinking)
            w.close("message")
            w.out.append(Segment(END_OF_MSG, True))
    if preamble and tool_choice in _TOOL_CHOICE_BODY:
        w.message([("role", "system"), ("type", "tool-choice")], _TOOL_CHOICE_BODY[tool_choice])
    w.open("message", ("role", "assistant"))
    w.open("think" if thinking else "response")
    if w.images is not None and w.used != len(w.images):
        raise ValueError(f"messages hold {w.used} image placeholders for {len(w.images)} images")
    return w.out


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _assistant(w: _Writer, m: dict[str, Any], thinking: bool) -> None:
    """A past reply's channels (the think channel, always opened and closed with thinking on)."""
    if thinking:
        w.open("think")
        if (m.get("reasoning_content") or "").strip():
            w.content(m["reasoning_content"])
        w.close("think")
    w.open("response")
    w.content(m["content"])
    w.close("response")
    if not m.get("tool_calls"):
        return
    w.open("tools")
    for k, call in enumerate(m["tool_calls"], start=1):
        w.open("call", ("tool", call["function"]["name"]), ("index", k))
        args = _arguments(call["function"]["arguments"], "arguments")
        if isinstance(args, str):
            w.open("json", ("type", "object"))
            w.content(args)
            w.close("json")
        else:
            for key, value in args.items():
                w.open("argument", ("key", key), ("type", _xtml_type(value)))
                w.content(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                w.close("argument")
        w.close("call")
    w.close("tools")


# ------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class ToolCall:
    """A tool call of a reply: its tool's name and its arguments as JSON object text (OpenAI's
    `function.arguments`; the raw text when the model wrote a json element that does not parse)."""

    name: str
    arguments: str
    index: int = 0  # its place among the reply's calls

    def args(self) -> dict[str, Any]:
        """The arguments as a dict; ValueError naming the tool when they are not a JSON object."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.name!r}: its arguments are not a JSON object: {self.arguments[:80]!r}")
        return value

    def openai(self, call_id: str) -> dict[str, Any]:
        """OpenAI's shape of the call (a message's `tool_calls` entry)."""
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ChatDelta:
    """What a piece of a reply added: reasoning text, content text, and the tool calls it completed."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


@dataclass(frozen=True)
class ChatTurn:
    """A whole reply: the think channel's text (None: the reply had no think channel, thinking off), the
    response channel's text (what the user sees; text outside any channel counts here too), and its tool
    calls in order."""

    reasoning: str | None
    content: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass
class _Element:
    tag: str
    attrs: dict[str, str]
    value: list[int] = field(default_factory=list)  # an argument's / json element's ids
    args: dict[str, Any] = field(default_factory=dict)  # a call's arguments so far
    raw: str | None = None  # a call's json element


class ReplyParser:
    """One reply, parsed as its ids arrive (`K3Chat.stream`): `feed(ids)` -> the `ChatDelta` they complete,
    `finish()` -> the rest (text held back for an incomplete character); `turn` is everything so far. Any
    split of the same ids gives the same turn. Never raises on what a model writes: a stray marker is dropped,
    a close without its open ignored, text outside any channel is content, and everything after
    `<|end_of_msg|>` is ignored (`done`)."""

    def __init__(self, chat: K3Chat):
        self._chat = chat
        self._stack: list[_Element] = []
        self._header: list[int] | None = None  # ids after <|open|> / <|close|>, until <|sep|>
        self._closing = False
        self._run: Decoder | None = None  # the reasoning / content text being decoded
        self._run_to = ""
        self._thinking = False  # a think channel was opened
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self.done = False

    @property
    def turn(self) -> ChatTurn:
        reasoning = "".join(self._reasoning) if self._thinking else None
        return ChatTurn(reasoning, "".join(self._content), tuple(self._calls))

    def feed(self, ids: Sequence[int]) -> ChatDelta:
        out = ChatDelta()
        c = self._chat
        for t in ids:
            if self.done:
                break
            t = int(t)
            if self._header is not None:
                if t == c.sep_id:
                    self._end_header(out)
                    continue
                if t not in (c.open_id, c.close_id, c.end_of_msg_id):
                    self._header.append(t)
                    continue
                self._header = None  # a header cut by another marker: dropped
            if t in (c.open_id, c.close_id):
                self._end_run(out)
                self._header, self._closing = [], t == c.close_id
            elif t == c.end_of_msg_id:
                self._end_run(out)
                self.done = True
            elif t != c.sep_id:  # a stray <|sep|> is dropped
                self._text(t, out)
        return out

    def finish(self) -> ChatDelta:
        """The text held back at the end; a cut header or call is dropped."""
        out = ChatDelta()
        self._end_run(out)
        return out

    def _restart(self) -> None:
        """Forget the text read so far (the prompt's), keeping where the reply stands."""
        self._run = None
        self._reasoning, self._content, self._calls = [], [], []

    # -- text
    def _target(self) -> tuple[str, _Element | None]:
        for e in reversed(self._stack):
            if e.tag == "think":
                return "reasoning", None
            if e.tag in ("response", "message"):
                return "content", None
            if e.tag in ("argument", "json"):
                return "value", e
            if e.tag in ("tools", "call"):
                return "", None
        return "content", None

    def _text(self, t: int, out: ChatDelta) -> None:
        to, element = self._target()
        if to == "value":
            element.value.append(t)
        elif to:
            if self._run is None or self._run_to != to:
                self._end_run(out)
                self._run, self._run_to = Decoder(self._chat.decode), to
            self._emit(to, self._run.push([t]), out)

    def _end_run(self, out: ChatDelta) -> None:
        if self._run is not None:
            self._emit(self._run_to, self._run.finish(), out)
            self._run = None

    def _emit(self, to: str, text: str, out: ChatDelta) -> None:
        if text:
            (self._reasoning if to == "reasoning" else self._content).append(text)
            if to == "reasoning":
                out.reasoning += text
            else:
                out.content += text

    # -- elements
    def _end_header(self, out: ChatDelta) -> None:
        tag, attrs = self._chat.header(self._header)
        self._header = None
        if not tag:
            return
        if not self._closing:
            self._stack.append(_Element(tag, attrs))
            self._thinking = self._thinking or tag == "think"
            return
        at = next((k for k in range(len(self._stack) - 1, -1, -1) if self._stack[k].tag == tag), None)
        if at is None:
            return  # a close without its open
        while len(self._stack) > at:
            self._pop(out, explicit=len(self._stack) == at + 1)

    def _pop(self, out: ChatDelta, explicit: bool) -> None:
        e = self._stack.pop()
        call = next((x for x in reversed(self._stack) if x.tag == "call"), None)
        if e.tag == "argument" and call is not None:
            text = self._chat.decode(e.value)
            value: Any = text
            if e.attrs.get("type", "string") != "string":
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    pass
            call.args[e.attrs.get("key", "")] = value
        elif e.tag == "json" and call is not None:
            call.raw = self._chat.decode(e.value)
        elif e.tag == "call" and explicit and e.attrs.get("tool"):
            arguments = e.raw if e.raw is not None else json.dumps(e.args, ensure_ascii=False)
            done = ToolCall(e.attrs["tool"], arguments, len(self._calls))
            self._calls.append(done)
            out.tool_calls.append(done)


# ------------------------------------------------------------------ the codec
def own_renderer(hf: Any) -> bool:
    """Whether the tokenizer's `apply_chat_template` is its own code (K3's remote code renders ids itself)
    rather than transformers' Jinja renderer."""
    owner = next((k for k in type(hf).__mro__ if "apply_chat_template" in vars(k)), None)
    return owner is not None and not owner.__module__.startswith("transformers.")


def generation_stop_ids(path: str | Path | None) -> tuple[int, ...]:
    """The eos ids of the checkpoint's generation_config.json (an int or a list), () without one. One-line
    ValueError naming the file when it does not read or its eos_token_id is not ids."""
    if path is None or not (Path(path) / GENERATION_CONFIG).is_file():
        return ()
    file = Path(path) / GENERATION_CONFIG
    try:
        eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{file}: cannot read the generation config ({e})") from None
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else [] if eos is None else None
    if ids is None or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


class K3Chat:
    """K3's chat encoding over a checkpoint's tokenizer (module docstring). ValueError naming the token when the
    tokenizer lacks one of K3's structure tokens (`STRUCTURE_TOKENS`, each one special id)."""

    def __init__(self, hf: Any, path: str | Path | None = None):
        self.hf = hf
        where = f"the tokenizer in {path}" if path is not None else "the tokenizer"
        ids = {}
        for token in STRUCTURE_TOKENS:
            tid = _special_id(hf, token)
            if tid is None:
                raise ValueError(f"{where} has no K3 structure token {token} (K3's chat needs {STRUCTURE_TOKENS})")
            ids[token] = tid
        self.open_id, self.close_id, self.sep_id, self.end_of_msg_id = (ids[t] for t in STRUCTURE_TOKENS)
        self.own_renderer = own_renderer(hf)
        # the stop: the checkpoint's generation_config eos ids, else <|end_of_msg|>; the end of a turn is
        # <|end_of_msg|> when the checkpoint lists it, else its first eos
        self.stop_token_ids = generation_stop_ids(path) or (self.end_of_msg_id,)
        ends = self.stop_token_ids
        self.end_of_turn_id = self.end_of_msg_id if self.end_of_msg_id in ends else ends[0]

    @classmethod
    def detect(cls, hf: Any, path: str | Path | None = None) -> K3Chat | None:
        """The codec when the tokenizer speaks K3's chat (its structure tokens, and its own renderer or no Jinja
        template), else None."""
        if not all(_special_id(hf, t) is not None for t in STRUCTURE_TOKENS):
            return None
        if getattr(hf, "chat_template", None) and not own_renderer(hf):
            return None
        return cls(hf, path)

    # -- ids and text
    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text (a user's, a tool's) -> ids: a marker in it is never a special token."""
        piece = getattr(self.hf, "_encode_text_piece", None)  # K3's own tokenizer
        if piece is not None:
            return list(piece(text, allow_special_tokens=False))
        return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _encode_special(self, text: str) -> list[int]:
        piece = getattr(self.hf, "_encode_text_piece", None)
        if piece is not None:
            return list(piece(text, allow_special_tokens=True))
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_segments(self, segments: Sequence[Segment]) -> list[int]:
        """Each segment on its own: a structure token its id, an image block with its special tokens, text as
        untrusted text."""
        ids: list[int] = []
        structure = {OPEN: self.open_id, CLOSE: self.close_id, SEP: self.sep_id, END_OF_MSG: self.end_of_msg_id}
        for s in segments:
            if s.special:
                ids += [structure[s.text]] if s.text in structure else self._encode_special(s.text)
            else:
                ids += self.encode_text(s.text)
        return ids

    def header(self, ids: Sequence[int]) -> tuple[str, dict[str, str]]:
        """An element header's ids (between <|open|> or <|close|> and <|sep|>) -> (tag, attributes)."""
        text = self.hf.decode(list(ids), skip_special_tokens=False).strip()
        tag, _, rest = text.partition(" ")
        attrs = {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(rest)}
        return tag, attrs

    # -- rendering
    def render(
        self,
        messages: list[Any],
        tools: list[dict[str, Any]] | None = None,
        *,
        thinking: bool = True,
        thinking_effort: str = "max",
        tool_choice: str | None = None,
        image_prompts: Sequence[str] | None = None,
    ) -> list[int]:
        """A conversation -> prompt ids asking for the assistant's reply: by the tokenizer's own renderer
        (`own_renderer`: K3's remote code, with `thinking`, `tools`, `thinking_effort`, `tool_choice` and
        `image_prompts` passed through), else `chat_segments`. The messages are checked first
        (`check_chat_messages`; ValueError "messages[i]..."), and the tools (`check_tools`)."""
        messages = check_chat_messages(messages)
        tools = check_tools(tools) if tools else None
        if not self.own_renderer:
            segments = chat_segments(
                messages,
                tools,
                thinking=thinking,
                thinking_effort=thinking_effort,
                tool_choice=tool_choice,
                image_prompts=image_prompts,
            )
            return self.encode_segments(segments)
        kwargs: dict[str, Any] = dict(thinking=thinking, thinking_effort=thinking_effort)
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        if image_prompts is not None:
            kwargs["image_prompts"] = list(image_prompts)
        try:
            out = self.hf.apply_chat_template(
                messages, tools=tools, tokenize=True, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # the remote code's own refusals
            raise ValueError(f"messages: the tokenizer's K3 renderer rejected them: {e}") from None
        out = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in (out.tolist() if hasattr(out, "tolist") else out)]

    def continuation(self, messages: list[Any], *, thinking: bool = True) -> list[int]:
        """Ids to append after a finished reply (it ended with <|end_of_msg|>): `messages` (tool results, a user
        message) and the next generation prompt, without the preamble; what a multi-turn rollout adds as
        environment tokens. A tool result names its tool (`name`) or is matched to the previous reply's calls
        by the caller."""
        segments = chat_segments(check_chat_messages(messages), thinking=thinking, preamble=False)
        return self.encode_segments(segments)

    # -- parsing
    def stream(self, prompt_ids: Sequence[int]) -> ReplyParser:
        """A parser for the reply that follows `prompt_ids`: it starts where the prompt's last assistant message
        stands (its open channel: think or response), the prompt's own text not counted."""
        parser = ReplyParser(self)
        start = self._reply_start(prompt_ids)
        if start is not None:
            parser.feed(prompt_ids[start:])
            parser._restart()
        return parser if not parser.done else ReplyParser(self)  # a finished message: the reply starts anew

    def reply(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> ChatTurn:
        """The whole reply `output_ids` to `prompt_ids` (`stream`, fed at once)."""
        parser = self.stream(prompt_ids)
        parser.feed(output_ids)
        parser.finish()
        return parser.turn

    def fill(self, sample: Sample) -> None:
        """A sample's `response` (the response channel), `reasoning` and `tool_calls`, from the last reply in its
        ids (a multi-turn sample: the last assistant message of prompt + output)."""
        output = list(sample.output_ids)
        start = self._reply_start(output)  # a later reply of a multi-turn output
        if start is None:
            turn = self.reply(sample.prompt_ids, output)
        else:
            parser = ReplyParser(self)
            parser.feed(output[start:])
            parser.finish()
            turn = parser.turn
        sample.response, sample.reasoning, sample.tool_calls = turn.content, turn.reasoning, list(turn.tool_calls)

    def _reply_start(self, ids: Sequence[int]) -> int | None:
        """The position of the last `<|open|>message role="assistant"<|sep|>` in `ids`, None if none."""
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] != self.open_id:
                continue
            end = next((k for k in range(i + 1, len(ids)) if ids[k] in (self.sep_id, self.open_id)), None)
            if end is not None and ids[end] == self.sep_id:
                tag, attrs = self.header(ids[i + 1 : end])
                if tag == "message" and attrs.get("role") == "assistant":
                    return i
        return None


def _special_id(hf: Any, token: str) -> int | None:
    """The one special id of `token` in the tokenizer, None when it has none."""
    try:
        tid = hf.convert_tokens_to_ids(token)
    except (KeyError, ValueError, TypeError):
        return None
    if not isinstance(tid, int) or tid == getattr(hf, "unk_token_id", None) or tid < 0:
        return None
    return tid if hf.decode([tid], skip_special_tokens=False) == token else None


_DETECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_of(tok: Any) -> K3Chat | None:
    """The K3 chat codec behind a run tokenizer: a `K3ChatPrompts`' own, or one detected on an `HFTokenizer`
    (`K3Chat.detect`, once per tokenizer), else None."""
    chat = getattr(tok, "chat", None)
    if chat is not None or not isinstance(tok, HFTokenizer):
        return chat
    if tok not in _DETECTED:
        _DETECTED[tok] = K3Chat.detect(tok.hf, tok.path)
    return _DETECTED[tok]


def read_reply(tok: Any, sample: Sample) -> None:
    """Set what the reward reads of a sample's output: with a K3 chat run tokenizer (`K3ChatPrompts`) its
    `response` channel, `reasoning` and `tool_calls` (`K3Chat.fill`), else `response` = the decoded output."""
    chat = getattr(tok, "chat", None)
    if chat is None:
        sample.response = tok.decode(sample.output_ids)
    else:
        chat.fill(sample)


# ------------------------------------------------------------------ the run's prompts
class RenderedChat(str):
    """A prompt K3's chat encoding rendered: the text (its ids decoded, structure tokens shown) that the
    dataset's records, logs and rewards read, carrying the ids the engine and the trainer read (`ids`)."""

    ids: tuple[int, ...]

    def __new__(cls, text: str, ids: Sequence[int] = ()):
        out = super().__new__(cls, text)
        out.ids = tuple(ids)
        return out


class K3ChatPrompts:
    """The run's tokenizer under data.chat_template=k3: prompts are `RenderedChat`s (`render`: messages ->
    ids through `K3Chat.render`, never text encoded again), the eos is the checkpoint's end-of-turn token
    (`K3Chat.end_of_turn_id`: the loop stops there), text is encoded as untrusted text, decoding is the
    tokenizer's, and `chat` parses replies (`read_reply`)."""

    def __init__(self, base: HFTokenizer, chat: K3Chat, thinking: bool = True):
        self._base, self.chat, self.thinking = base, chat, thinking
        self.eos_token_id = chat.end_of_turn_id

    def render(self, messages: list[Any], tools: list[dict[str, Any]] | None = None) -> RenderedChat:
        """A dataset prompt: messages (and the row's tools) -> its `RenderedChat`."""
        ids = self.chat.render(messages, tools, thinking=self.thinking)
        return RenderedChat(self._base.decode(ids, skip_special_tokens=False), ids)

    def encode_prompt(self, text: str) -> list[int]:
        if isinstance(text, RenderedChat):
            return list(text.ids)
        raise ValueError(
            "prompt: under data.chat_template=k3 a prompt is rendered to ids from its messages; "
            f"plain text is not encoded again ({text[:40]!r})"
        )

    def encode(self, text: str) -> list[int]:
        return self.chat.encode_text(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._base.decode(ids, skip_special_tokens)
