"""OpenAI-compatible routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Field names follow OpenAI's API reference (and the `openai` package's types, which parse every response
here). `model` selects the base (its served name) or a loaded adapter (the adapter's name).

Supported request fields
    both        model, n, seed (sample i of a prompt draws from seed + i), stop (a string or a list),
                max_tokens, temperature, top_p, stream, stream_options.include_usage, user (ignored)
    completions prompt (a string, a list of strings, a list of token ids, or a list of those), logprobs
                (0..20: the sampled tokens' log-probs and, per token, the N most likely as {text: log-prob}),
                best_of (= n only), echo (false only), suffix (null only)
    chat        messages (through the tokenizer's chat template; content a string or text and image_url
                parts, images as data URLs on a vision-language checkpoint: `rollout.server.images`), logprobs (bool),
                top_logprobs (0..20, with logprobs), max_completion_tokens, response_format ({"type": "text"} only),
                metadata / store / service_tier / parallel_tool_calls / prompt_cache_key /
                safety_identifier (ignored: they carry no meaning for generation here)
    extensions  (vLLM's / SGLang's names, e.g. through the openai package's `extra_body`) top_k,
                ignore_eos, stop_token_ids, skip_special_tokens, no_stop_trim
    K3 chat     on a checkpoint whose tokenizer speaks K3's chat (`ServerTokenizer.chat`,
                `miles_k3.data.k3_chat`): messages may carry assistant `tool_calls` / `reasoning_content` and
                tool results (`tool_call_id`, `name`); tools (OpenAI's functions), tool_choice ("auto", "none",
                "required"), chat_template_kwargs {thinking (default true), thinking_effort}. The prompt is
                rendered straight to ids, the reply ends at the checkpoint's end-of-turn token, and its tokens
                are parsed into the message's `reasoning_content`, `content` and `tool_calls` (streamed as
                deltas of the same fields; a tool call arrives whole, once its call closes; finish_reason
                "tool_calls" when the reply called tools).
Refused unless at their neutral value (400): frequency_penalty, presence_penalty, logit_bias, tools and
tool_choice (taken under K3 chat), functions, function_call, audio, modalities, prediction. Any other field is
a 400 ("unknown field").

Log-probs are those of the sampled token under the untruncated distribution at the request's temperature
(temperature 1 when greedy), as the engine computes them for RL; top log-probs come from that same
distribution in the same step. A request aborted by a caller (`/abort_request`, `/pause_generation` with
mode abort) finishes with finish_reason "abort" (SGLang's OpenAI server's word; OpenAI has none for it); only
a server going away answers 503. `usage.prompt_tokens` counts each prompt
once whatever n; `prompt_tokens_details.cached_tokens` the prompt tokens served from the prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from miles_k3.data.k3_chat import (
    THINKING_EFFORTS,
    TOOL_CHOICES,
    ChatTurn,
    K3Chat,
    ReplyParser,
    check_chat_message,
    check_tools,
)
from miles_k3.data.media import image_block, media_pad_positions
from rollout.request import SamplingParams
from rollout.server.generation import Choice, Delta, Generation, GenerationRequest, RequestError
from rollout.server.images import ImagePart, images_prompt_ids, message_text, process_images
from rollout.server.protocol import (
    Fields,
    ServerContext,
    encode,
    error_body,
    new_id,
    parse_body,
    prompt_ids,
    sse,
)
from rollout.server.responses import collect, json_error, read_body, stream_response

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits
_IGNORED_CHAT = (
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
    "user",
)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for completions logprobs and chat top_logprobs


def _sampling(f: Fields) -> dict[str, Any]:
    """The sampling fields both endpoints share, checked; what SamplingParams and GenerationRequest take."""
    for key in ("frequency_penalty", "presence_penalty"):
        f.neutral(key, 0, 0.0)
    f.neutral("logit_bias", {})
    seed = f.int("seed", None, low=0, high=2**63 - 1)
    top_k = f.int("top_k", 0, low=-1)
    return dict(
        temperature=f.number("temperature", 1.0, low=0.0),
        top_p=f.number("top_p", 1.0, low=0.0, high=1.0, open_low=True),
        top_k=0 if top_k == -1 else top_k,
        seed=seed,
        stop=f.strings("stop"),
        stop_token_ids=f.token_ids("stop_token_ids"),
        ignore_eos=f.bool("ignore_eos", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        keep_stop=f.bool("no_stop_trim", False),
    )


def _requests(
    prompts: list[list[int]],
    s: dict[str, Any],
    n: int,
    adapter: str | None,
    max_new: int | None,
    max_key: str,
    default_max: int | None,
    ctx: ServerContext,
    images: list | None = None,
    top_logprobs: int = 0,
) -> list[GenerationRequest]:
    out = []
    for ids in prompts:
        tokens = ctx.check_length(len(ids), max_new, max_key, default_max)
        params = SamplingParams(
            temperature=s["temperature"],
            top_p=s["top_p"],
            top_k=s["top_k"],
            max_new_tokens=tokens,
            stop_token_ids=s["stop_token_ids"],
            seed=s["seed"],
            top_logprobs=top_logprobs,
        )
        out.append(
            GenerationRequest(
                ids,
                params,
                n,
                adapter,
                s["stop"],
                s["keep_stop"],
                s["ignore_eos"],
                s["skip_special_tokens"],
                tuple(images or ()),
            )
        )
    return out


def _usage(gen: Generation, samples: list[Choice]) -> dict[str, Any]:
    by_prompt: dict[int, list[Choice]] = {}
    for st, s in zip(gen.states, samples):
        by_prompt.setdefault(id(st.req), []).append(s)
    prompt = sum(len(ss[0].prompt_ids) for ss in by_prompt.values())
    completion = sum(len(s.token_ids) for s in samples)
    cached = sum(min(s.cached_tokens for s in ss) for ss in by_prompt.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _shutting_down() -> RequestError:
    return RequestError("the request was aborted: the server is shutting down", status=503)


def _finish(s: Choice) -> str | None:
    """A finished sample's finish_reason; a 503 when the server aborted it on its way down (a caller's abort
    is finish_reason "abort")."""
    if s.shutdown:
        raise _shutting_down()
    return s.finish_reason


# ------------------------------------------------------------------ log-prob layouts
def _completion_logprobs(
    ctx: ServerContext, ids: list[int], lps: list[float], offset: int, top: list | None
) -> dict[str, Any]:
    """OpenAI's completions layout; `top`: per token its (id, log-prob) alternatives, as {text: log-prob}."""
    text = ctx.tokenizer.token_text
    tokens = [text(t) for t in ids]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = None if top is None else [{text(t): lp for t, lp in alts} for alts in top]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(ctx: ServerContext, ids: list[int], lps: list[float], top: list | None) -> dict[str, Any]:
    """OpenAI's chat layout; `top`: per token its (id, log-prob) alternatives (None: top_logprobs 0)."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        text = ctx.tokenizer.token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        alts = [] if top is None else [entry(a, alp) for a, alp in top[i]]
        content.append({**entry(t, lp), "top_logprobs": alts})
    return {"content": content, "refusal": None}


# ------------------------------------------------------------------ routes
async def list_models(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    base = {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "miles-k3",
        "root": ctx.model_path,
        "parent": None,
        "max_model_len": ctx.max_seq_len,
    }
    adapters = [{**base, "id": name, "root": name, "parent": ctx.model_name} for name in ctx.adapters]
    return JSONResponse({"object": "list", "data": [base, *adapters]})


def _completion_prompts(value: Any, ctx: ServerContext) -> list[list[int]]:
    if isinstance(value, str):
        return [encode(ctx.tokenizer.encode, value, "prompt")]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [prompt_ids(value, "prompt", ctx.vocab_size)]
    if isinstance(value, list) and value:
        out = []
        for i, p in enumerate(value):
            if isinstance(p, str):
                out.append(encode(ctx.tokenizer.encode, p, f"prompt[{i}]"))
            else:
                out.append(prompt_ids(p, f"prompt[{i}]", ctx.vocab_size))
        return out
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids, or a list of those", param="prompt"
    )


async def completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = Fields(parse_body(await read_body(request)))
        adapter = ctx.adapter_for(f.required("model"))
        prompts = _completion_prompts(f.required("prompt"), ctx)
        n = f.int("n", 1, low=1)
        best_of = f.int("best_of", None, low=1)
        if best_of is not None and best_of != n:
            raise f.fail("best_of", f"must equal n ({n}): this server returns every sample it draws")
        f.neutral("echo", False)
        f.neutral("suffix", "")
        logprobs = f.int("logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
        s = _sampling(f)
        max_new = f.int("max_tokens", None, low=1)
        stream, include_usage = f.bool("stream", False), _stream_options(f)
        f.ignore("user")
        f.finish()
        reqs = _requests(
            prompts, s, n, adapter, max_new, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, ctx, None, logprobs or 0
        )
        gen = ctx.service.open(reqs)
    except RequestError as e:
        return json_error(e)
    meta = {"id": f"cmpl-{new_id()}", "object": "text_completion", "created": int(time.time()), "model": f.obj["model"]}
    want_lp = logprobs is not None
    if stream:
        return await stream_response(request, gen, _completion_chunks(ctx, gen, meta, want_lp, include_usage))
    samples = await collect(request, gen)
    if not isinstance(samples, list):
        return samples
    try:
        choices = [
            {
                "index": s.index,
                "text": s.text,
                "finish_reason": _finish(s),
                "logprobs": _completion_logprobs(ctx, s.token_ids, s.logprobs, 0, s.top_logprobs) if want_lp else None,
            }
            for s in samples
        ]
    except RequestError as e:
        return json_error(e)
    return JSONResponse({**meta, "choices": choices, "usage": _usage(gen, samples), "system_fingerprint": None})


async def chat_completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    try:
        f = Fields(parse_body(await read_body(request)))
        adapter = ctx.adapter_for(f.required("model"))
        messages = f.required("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
        chat = ctx.tokenizer.chat
        parts: list[ImagePart] = []
        try:
            checked = [(message_text if chat is None else _k3_message_in)(i, m, parts) for i, m in enumerate(messages)]
        except ValueError as e:  # "messages[1].content[0] must be ...": the field is the message's first word
            field = str(e).split(" ", 1)[0].rstrip(":")
            raise RequestError(str(e), param=field if field.startswith("messages") else "messages") from None
        n = f.int("n", 1, low=1)
        want_lp = f.bool("logprobs", False)
        top = f.int("top_logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
        if top and not want_lp:
            raise f.fail("top_logprobs", "needs logprobs: true")
        k3 = None if chat is None else _k3_options(f)
        for key in ("functions",) if chat is not None else ("tools", "functions"):
            f.neutral(key, [])
        for key in ("function_call",) if chat is not None else ("tool_choice", "function_call"):
            f.neutral(key, "none")
        for key in ("audio", "modalities", "prediction"):
            f.neutral(key, ["text"] if key == "modalities" else None)
        fmt = f.raw("response_format", None)
        if fmt is not None and fmt != {"type": "text"}:
            raise f.fail("response_format", "is not supported by this server (only {'type': 'text'})")
        s = _sampling(f)
        max_new = f.int("max_completion_tokens", None, low=1)
        key = "max_completion_tokens"
        if max_new is None:
            max_new, key = f.int("max_tokens", None, low=1), "max_tokens"
        stream, include_usage = f.bool("stream", False), _stream_options(f)
        f.ignore(*_IGNORED_CHAT)
        f.finish()
        # the images after every cheap check; decoded and resized off the event loop (streams keep flowing)
        images = await asyncio.to_thread(process_images, ctx, parts) if parts else []
        if chat is None:
            ids = images_prompt_ids(ctx, {"messages": checked}, images, "messages")
        else:
            ids = encode(lambda m: _k3_prompt(ctx, chat, m, k3, images), checked, "messages")
        gen = ctx.service.open(_requests([ids], s, n, adapter, max_new, key, None, ctx, images, top))
    except RequestError as e:
        return json_error(e)
    meta = {
        "id": f"chatcmpl-{new_id()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": f.obj["model"],
    }
    if stream:
        return await stream_response(request, gen, _chat_chunks(ctx, gen, meta, want_lp, include_usage))
    samples = await collect(request, gen)
    if not isinstance(samples, list):
        return samples
    try:
        choices = []
        for s in samples:
            message, finish = {"role": "assistant", "content": s.text}, _finish(s)
            if chat is not None:
                turn = chat.reply(s.prompt_ids, s.token_ids)
                message = {"role": "assistant", **_k3_fields(turn, whole=True)}
                finish = "tool_calls" if turn.tool_calls and finish == "stop" else finish
            lp = _chat_logprobs(ctx, s.token_ids, s.logprobs, s.top_logprobs) if want_lp else None
            choices.append({"index": s.index, "message": message, "finish_reason": finish, "logprobs": lp})
    except RequestError as e:
        return json_error(e)
    return JSONResponse({**meta, "choices": choices, "usage": _usage(gen, samples), "system_fingerprint": None})


def _stream_options(f: Fields) -> bool:
    opts = f.raw("stream_options", None)
    if opts is None:
        return False
    g = Fields(opts, "stream_options")
    include = g.bool("include_usage", False)
    g.ignore("include_obfuscation")
    g.finish()
    return include


# ------------------------------------------------------------------ answering
async def _completion_chunks(ctx, gen: Generation, meta, want_lp: bool, include_usage: bool):
    offsets = [0] * len(gen.states)
    async for d in _deltas_first(gen):
        if isinstance(d, RequestError):
            yield sse(error_body(d))
            break
        lp = None
        if want_lp:
            lp = _completion_logprobs(ctx, d.token_ids, d.logprobs, offsets[d.index], d.top)
        offsets[d.index] += len(d.text)
        yield sse(
            {**meta, "choices": [{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}]}
        )
    else:
        if include_usage:
            yield sse({**meta, "choices": [], "usage": _usage(gen, [st.sample for st in gen.states])})
    yield sse("[DONE]")


async def _chat_chunks(ctx, gen: Generation, meta, want_lp: bool, include_usage: bool):
    meta = {**meta, "object": "chat.completion.chunk"}
    started: set[int] = set()
    k3 = None if ctx.tokenizer.chat is None else K3Stream(ctx.tokenizer.chat, [st.req.prompt_ids for st in gen.states])
    async for d in _deltas_first(gen):
        if isinstance(d, RequestError):
            yield sse(error_body(d))
            break
        delta, finish = ({"content": d.text}, d.finish_reason) if k3 is None else k3.delta(d)
        if d.index not in started:
            started.add(d.index)
            delta["role"] = "assistant"
        lp = _chat_logprobs(ctx, d.token_ids, d.logprobs, d.top) if want_lp else None
        yield sse({**meta, "choices": [{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]})
    else:
        if include_usage:
            yield sse({**meta, "choices": [], "usage": _usage(gen, [st.sample for st in gen.states])})
    yield sse("[DONE]")


# ------------------------------------------------------------------ K3 chat
def _k3_message_in(i: int, message: Any, parts: list) -> dict[str, Any]:
    """messages[i] of a K3 chat request: role and content as every chat request reads them (`message_text`:
    image parts collected into `parts`), plus K3's fields (`check_chat_message`: tool calls, reasoning, tool
    results). An assistant message's content may be null when it carries tool calls."""
    if isinstance(message, dict) and message.get("content") is None and message.get("tool_calls"):
        message = {**message, "content": ""}
    content = message_text(i, message, parts)["content"]
    return check_chat_message(i, {**message, "content": content}, None)


def _k3_options(f: Fields) -> dict[str, Any]:
    """A K3 chat request's tools, tool_choice and chat_template_kwargs (thinking, thinking_effort), checked."""
    tools = f.raw("tools", None)
    if tools is not None:
        try:
            tools = check_tools(tools) or None  # [] offers no tools
        except ValueError as e:  # "tools[0].function.name must be ...": the field is its first word
            raise RequestError(str(e), param=str(e).split(" ", 1)[0]) from None
    choice = f.raw("tool_choice", None)
    if choice is not None and choice not in TOOL_CHOICES:
        raise f.fail("tool_choice", f"must be one of {list(TOOL_CHOICES)} (a named tool is not supported for K3)")
    kw = Fields(f.raw("chat_template_kwargs", {}), "chat_template_kwargs")
    thinking = kw.bool("thinking", True)
    effort = kw.str("thinking_effort", "max")
    if effort not in THINKING_EFFORTS:
        raise kw.fail("thinking_effort", f"must be one of {list(THINKING_EFFORTS)}")
    kw.finish()
    return dict(tools=tools, tool_choice=choice, thinking=thinking, thinking_effort=effort)


def _k3_prompt(ctx: ServerContext, chat: K3Chat, messages: list[dict], options: dict, images: list) -> list[int]:
    """The prompt ids of a K3 chat request: rendered by the checkpoint's K3 encoding, each image placeholder
    its image's XTML block (special tokens), the pad runs checked against the images."""
    tools = options["tools"]
    rest = {k: v for k, v in options.items() if k != "tools"}
    if not images:
        return chat.render(messages, tools, **rest)
    ids = chat.render(messages, tools, image_prompts=[image_block(im) for im in images], **rest)
    media_pad_positions(ids, images, ctx.media_pad_id)
    return ids


def _k3_fields(turn: ChatTurn, whole: bool) -> dict[str, Any]:
    """A reply's message fields in OpenAI's shapes: `reasoning_content` (thinking on), `content` (null in a
    whole message that only calls tools), `tool_calls` (each with a fresh id; in a delta, with its index).
    A delta (`whole` False) carries only the fields that have something new."""
    out: dict[str, Any] = {}
    if turn.reasoning is not None and (whole or turn.reasoning):
        out["reasoning_content"] = turn.reasoning
    if whole or turn.content:
        out["content"] = turn.content if (turn.content or not turn.tool_calls or not whole) else None
    if turn.tool_calls:
        out["tool_calls"] = [
            {**({} if whole else {"index": c.index}), **c.openai(f"call_{new_id()}")} for c in turn.tool_calls
        ]
    return out


class K3Stream:
    """A streamed K3 chat request's replies, one parser per choice (`K3Chat.stream` from its prompt): each
    `Delta`'s tokens become the chat delta's fields (`_k3_fields`), and a choice that called tools finishes
    with "tool_calls" instead of "stop"."""

    def __init__(self, chat: K3Chat, prompts: list[list[int]]):
        self.parsers: list[ReplyParser] = [chat.stream(p) for p in prompts]

    def delta(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        """(the delta's fields, its finish_reason)."""
        parser = self.parsers[d.index]
        new = parser.feed(d.token_ids)
        if d.finish_reason is not None:
            new.add(parser.finish())
        reasoning = new.reasoning if parser.turn.reasoning is not None else None
        fields = _k3_fields(ChatTurn(reasoning, new.content, tuple(new.tool_calls)), whole=False)
        finish = d.finish_reason
        return fields, "tool_calls" if finish == "stop" and parser.turn.tool_calls else finish


async def _deltas_first(gen: Generation) -> AsyncIterator[Delta | RequestError]:
    """Deltas; an error before the first one is raised (the route answers 4xx), after it is yielded. A sample
    the server aborted on its way down is a 503 error; a caller's abort is a delta with finish_reason "abort"."""
    started = False
    try:
        async for d in gen:
            if d.finish_reason == "abort" and gen.states[d.index].sample.shutdown:
                yield _shutting_down()
                return
            started = True
            yield d
    except RequestError as e:
        if not started:
            raise
        yield e


def routes() -> list[Route]:
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
