"""SGLang-native routes: POST /generate, GET /health, GET /health_generate, GET /get_model_info,
POST /abort_request. Field names and layouts are SGLang's (`GenerateReqInput`, `SamplingParams`, the
tokenizer manager's `meta_info`), so rollout code written for an SGLang server (miles', slime's
`sglang_rollout.generate`) posts here unchanged.

/generate request
    text | input_ids        one prompt (a string / a list of ids) or a batch (a list of those)
    sampling_params         an object, or one per prompt: max_new_tokens (default 128; null: all that fits),
                            temperature, top_p, top_k (-1: off), n, stop, stop_token_ids, ignore_eos,
                            sampling_seed, no_stop_trim, skip_special_tokens, stream_interval,
                            spaces_between_special_tokens (no effect: fast tokenizers ignore it),
                            custom_params (no effect without a custom logit processor, as in SGLang);
                            refused unless neutral: min_p, frequency/presence/repetition_penalty,
                            min_new_tokens, logit_bias, json_schema, regex, ebnf, structural_tag, stop_regex
    return_logprob          bool (or one per prompt); with it: top_logprobs_num (0..; or one per prompt),
                            token_ids_logprob (ids, or one list per prompt), logprob_start_len (-1: the last
                            prompt token only; k: prompt log-probs from position k; or one per prompt),
                            return_text_in_logprobs
    stream                  server-sent events, each the sample's output so far (SGLang's default,
                            non-incremental layout; "index" when several samples), then `data: [DONE]`
    rid                     an id (or one per prompt) that /abort_request can stop the request by
    return_routed_experts   bool: meta_info "routed_experts", every fed token's expert ids per MoE layer (prompt
                            and output but the last: [tokens, layers, top_k] int32, base64, as SGLang's), from
                            a server started with --record-routing
    lora_path               a loaded adapter's name (or one per prompt); null: the base
    image_data              with text, on a vision-language checkpoint: the images of each text's
                            <|kimi_image_placeholder|>s in order, each a data URL or base64 (a string or a
                            list for one text; one entry, or null, per text of a batch); never fetched
                            from a URL (`rollout.server.images`)
    ignored                 log_metrics, session_id; refused unless null/false: video and audio inputs,
                            input_embeds, return_hidden_states,
                            custom_logit_processor, session_params, priority, data_parallel_rank
/generate answer: {"text", "output_ids", "meta_info": {"id", "finish_reason" ({"type": "stop", "matched":
token id or string} | {"type": "length", "length": n} | {"type": "abort", ...}), "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency", "weight_version" (`/update_weight_version`'s), and with
return_logprob "output_token_logprobs" and "input_token_logprobs": [[logprob, token_id, text or null], ...],
with top_logprobs_num "output_top_logprobs" / "input_top_logprobs" (per position a list of such triples,
most likely first), with token_ids_logprob "output_token_ids_logprobs" / "input_token_ids_logprobs" (per
position one triple per given id)}}, laid out as SGLang's tokenizer manager does: the input lists cover the
prompt from logprob_start_len (default: its last token) and their first entry's log-prob is null (SGLang
reports no log-prob at the start position). One object for one prompt and n = 1, else a list, prompt-major;
a stream's events carry the lists so far.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from miles_k3.model.routing import encode_table
from rollout.request import SamplingParams
from rollout.server.generation import Choice, Generation, GenerationRequest, RequestError
from rollout.server.images import ImagePart, data_image_parts, images_prompt_ids, process_images
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
from rollout.server.responses import (
    ClientGone,
    collect,
    empty,
    json_error,
    read_body,
    stream_response,
    unless_disconnected,
)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
_NULL_ONLY = (
    "video_data",
    "audio_data",
    "input_embeds",
    "custom_logit_processor",
    "session_params",
    "priority",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)
_FALSE_ONLY = ("return_hidden_states", "return_prompt_token_ids", "return_entropy")


def _per_prompt(value: Any, count: int, key: str) -> list[Any]:
    """A field given once for the whole batch or as one value per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{key} has {len(value)} entries for {count} prompts", param=key)
        return value
    return [value] * count


def _prompts(f: Fields, ctx: ServerContext) -> tuple[list[list[int]], bool, list[list[ImagePart]]]:
    """(prompt ids, whether a batch was sent, each prompt's images not yet decoded). With `image_data` the
    ids are left empty: `_with_images` expands each text's placeholders once its images are processed."""
    text, ids = f.raw("text"), f.raw("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("exactly one of text and input_ids is required", param="text")
    image_data = f.raw("image_data")
    if image_data is not None:
        if text is None:
            raise RequestError(
                "image_data needs text: its <|kimi_image_placeholder|>s are expanded by the images "
                "(input_ids hold no placeholders)",
                param="image_data",
            )
        if isinstance(text, str):
            return [[]], False, [data_image_parts(image_data, "image_data")]
        if not (isinstance(text, list) and text and all(isinstance(t, str) for t in text)):
            raise RequestError("text must be a string or a non-empty list of strings", param="text")
        if not isinstance(image_data, list) or len(image_data) != len(text):
            raise RequestError(
                f"image_data must hold one entry per text ({len(text)}): each a data URL or base64 "
                "string, a list of them, or null",
                param="image_data",
            )
        return (
            [[] for _ in text],
            True,
            [[] if v is None else data_image_parts(v, f"image_data[{i}]") for i, v in enumerate(image_data)],
        )
    prompts, batch = _text_prompts(text, ids, ctx)
    return prompts, batch, [[] for _ in prompts]


async def _with_images(
    f: Fields, prompts: list[list[int]], parts: list[list[ImagePart]], ctx: ServerContext
) -> list[list]:
    """Each prompt's ProcessedImages (off the event loop), its ids from its text with them expanded."""
    if not any(parts):
        return [[] for _ in prompts]
    texts = f.obj["text"] if isinstance(f.obj["text"], list) else [f.obj["text"]]
    out = []
    for i, (text, p) in enumerate(zip(texts, parts)):
        images = await asyncio.to_thread(process_images, ctx, p) if p else []
        prompts[i] = images_prompt_ids(ctx, {"prompt": text}, images, f"text[{i}]" if len(texts) > 1 else "text")
        out.append(images)
    return out


def _text_prompts(text: Any, ids: Any, ctx: ServerContext) -> tuple[list[list[int]], bool]:
    if text is not None:
        if isinstance(text, str):
            return [encode(ctx.tokenizer.encode, text, "text")], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [encode(ctx.tokenizer.encode, t, f"text[{i}]") for i, t in enumerate(text)], True
        raise RequestError("text must be a string or a non-empty list of strings", param="text")
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        return [prompt_ids(p, f"input_ids[{i}]", ctx.vocab_size) for i, p in enumerate(ids)], True
    return [prompt_ids(ids, "input_ids", ctx.vocab_size)], False


@dataclasses.dataclass(frozen=True)
class LogprobAsk:
    """What one prompt's samples report: `top` alternatives, the log-probs of `ids`, prompt log-probs from
    `start` (SGLang's logprob_start_len, resolved: -1 is the prompt's last token)."""

    on: bool = False
    top: int = 0
    ids: tuple[int, ...] = ()
    start: int = 0

    def params(self, prompt_len: int) -> dict[str, Any]:
        """The SamplingParams fields: the engine computes prompt log-probs from start + 1 (SGLang's entry at
        `start` is null)."""
        if not self.on:
            return {}
        first = self.start + 1
        return dict(
            top_logprobs=self.top, token_ids_logprob=self.ids, logprob_start_len=first if first < prompt_len else -1
        )


def _logprob_asks(f: Fields, prompts: list[list[int]], on: list[bool], ctx: ServerContext) -> list[LogprobAsk]:
    """Each prompt's log-prob options (`top_logprobs_num`, `token_ids_logprob`, `logprob_start_len`), checked."""
    count = len(prompts)
    tops = _per_prompt(f.raw("top_logprobs_num", 0), count, "top_logprobs_num")
    starts = _per_prompt(f.raw("logprob_start_len", -1), count, "logprob_start_len")
    ids = f.raw("token_ids_logprob", None)
    if isinstance(ids, list) and ids and all(isinstance(x, list) or x is None for x in ids):
        id_lists = _per_prompt(ids, count, "token_ids_logprob")
    else:
        id_lists = [ids] * count
    asks = []
    for i, (p, want, top, start, wanted) in enumerate(zip(prompts, on, tops, starts, id_lists)):
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= ctx.vocab_size:
            raise RequestError(
                f"top_logprobs_num must be an integer in [0, {ctx.vocab_size}], got {top!r}", param="top_logprobs_num"
            )
        if isinstance(start, bool) or not isinstance(start, int) or not -1 <= start < len(p):
            raise RequestError(
                f"logprob_start_len must be -1 or a prompt position (< the prompt's {len(p)} tokens), got {start!r}",
                param="logprob_start_len",
            )
        wanted = [] if wanted is None else wanted
        if not isinstance(wanted, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < ctx.vocab_size for t in wanted
        ):
            raise RequestError(
                f"token_ids_logprob must be a list of token ids in [0, {ctx.vocab_size}) (or one per prompt), "
                f"got {wanted!r}",
                param="token_ids_logprob",
            )
        start = len(p) - 1 if start == -1 else start
        asks.append(LogprobAsk(want, top, tuple(wanted), start))
    return asks


def _sampling(
    sp: Any, where: str, prompt: list[int], ctx: ServerContext, adapter: str | None, ask: LogprobAsk = LogprobAsk()
) -> tuple[GenerationRequest, int]:
    """One prompt's GenerationRequest and its stream_interval."""
    f = Fields({} if sp is None else sp, where)
    for key, neutral in (
        ("min_p", (0, 0.0)),
        ("frequency_penalty", (0, 0.0)),
        ("presence_penalty", (0, 0.0)),
        ("repetition_penalty", (1, 1.0)),
        ("min_new_tokens", (0,)),
        ("logit_bias", ({},)),
        ("stop_regex", ([], "")),
    ):
        f.neutral(key, *neutral)
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        f.neutral(key)
    top_k = f.int("top_k", -1, low=-1)
    if top_k == 0:
        raise f.fail("top_k", "must be -1 (off) or >= 1")
    if "max_new_tokens" in f.obj and f.obj["max_new_tokens"] is None:
        f.seen.add("max_new_tokens")
        max_new, default = None, None  # SGLang: no limit but the context
    else:
        max_new, default = f.int("max_new_tokens", None, low=1), SGLANG_DEFAULT_MAX_NEW_TOKENS
    tokens = ctx.check_length(len(prompt), max_new, f.path("max_new_tokens"), default)
    params = SamplingParams(
        temperature=f.number("temperature", 1.0, low=0.0),
        top_p=f.number("top_p", 1.0, low=0.0, high=1.0, open_low=True),
        top_k=max(top_k, 0),
        max_new_tokens=tokens,
        stop_token_ids=f.token_ids("stop_token_ids"),
        seed=f.int("sampling_seed", None, low=0, high=2**63 - 1),
        **ask.params(len(prompt)),
    )
    req = GenerationRequest(
        prompt,
        params,
        n=f.int("n", 1, low=1),
        adapter=adapter,
        stop=f.strings("stop"),
        keep_stop=f.bool("no_stop_trim", False),
        ignore_eos=f.bool("ignore_eos", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
    )
    interval = f.int("stream_interval", 1, low=1)
    f.bool("spaces_between_special_tokens", True)
    custom = f.raw("custom_params", None)
    if custom is not None and not isinstance(custom, dict):
        raise f.fail("custom_params", "must be an object")
    f.finish()
    return req, interval


def _finish_reason(s: Choice) -> dict[str, Any] | None:
    if s.finish_reason == "stop":
        return {"type": "stop", "matched": s.matched}
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.token_ids)}
    if s.finish_reason == "abort":
        return {"type": "abort", "message": "aborted", "status_code": 400, "err_type": None}
    return None


def _output(
    ctx: ServerContext,
    s: Choice,
    rid: str,
    ask: LogprobAsk,
    with_text: bool,
    started: float,
    index: int | None,
    routed: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(s),
        "prompt_tokens": len(s.prompt_ids),
        "completion_tokens": len(s.token_ids),
        "cached_tokens": s.cached_tokens,
        "weight_version": ctx.weight_version,
        "e2e_latency": time.perf_counter() - started,
    }
    if ask.on:
        meta.update(_logprob_meta(ctx, s, ask, with_text))
    if routed and s.routed_experts is not None:  # every fed token's (prompt and output but the last), as SGLang
        meta["routed_experts"] = encode_table(s.routed_experts[: len(s.prompt_ids) + len(s.token_ids) - 1])
    out = {"text": s.text, "output_ids": list(s.token_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


async def generate(request: Request):
    ctx: ServerContext = request.app.state.ctx
    started = time.perf_counter()
    try:
        f = Fields(parse_body(await read_body(request)))
        prompts, batch, parts = _prompts(f, ctx)
        count = len(prompts)
        sps = _per_prompt(f.raw("sampling_params"), count, "sampling_params")
        lora = _per_prompt(f.raw("lora_path"), count, "lora_path")
        adapters = [None if name is None else ctx.adapter_for(name, "lora_path") for name in lora]
        logprob = [
            _bool(v, "return_logprob") for v in _per_prompt(f.raw("return_logprob", False), count, "return_logprob")
        ]
        with_text = f.bool("return_text_in_logprobs", False)
        routed = f.bool("return_routed_experts", False)
        if routed and ctx.service.loop.engine.runner.routing is None:
            raise RequestError(
                "return_routed_experts needs an engine that records routing (miles-serve --record-routing)",
                param="return_routed_experts",
            )
        f.ignore("top_logprobs_num", "token_ids_logprob", "logprob_start_len")  # read once the prompts are known
        for key in _NULL_ONLY:
            f.neutral(key)
        for key in _FALSE_ONLY:
            f.neutral(key, False)
        f.neutral("data_parallel_rank", 0)
        f.neutral("routed_dp_rank", 0)
        f.ignore("log_metrics", "session_id")
        stream = f.bool("stream", False)
        rids = _per_prompt(f.raw("rid", None), count, "rid")
        if any(r is not None and not isinstance(r, str) for r in rids):
            raise RequestError("rid must be a string or a list of strings", param="rid")
        f.finish()
        images = await _with_images(f, prompts, parts, ctx)  # after every cheap check
        per_prompt = isinstance(f.obj.get("sampling_params"), list)
        asks = _logprob_asks(f, prompts, logprob, ctx)
        built = [
            _sampling(sp, f"sampling_params[{i}]" if per_prompt else "sampling_params", p, ctx, a, ask)
            for i, (sp, p, a, ask) in enumerate(zip(sps, prompts, adapters, asks))
        ]
        built = [
            (dataclasses.replace(r, images=tuple(im)), every) if im else (r, every)
            for (r, every), im in zip(built, images)
        ]
        gen = ctx.service.open([r for r, _ in built], rids)
    except RequestError as e:
        return json_error(e)
    # per sample: its prompt's rid (suffixed by the sample's number when n > 1) and log-prob choice
    sample_rid, sample_lp, interval = [], [], []
    for (req, every), rid, lp in zip(built, rids, asks):
        base = rid or new_id()
        for j in range(req.n):
            sample_rid.append(base if req.n == 1 else f"{base}_{j}")
            sample_lp.append(lp)
            interval.append(every)
    many = batch or len(gen.states) > 1
    if stream:
        return await _stream(request, ctx, gen, sample_rid, sample_lp, with_text, interval, started, many, routed)
    samples = await collect(request, gen)
    if not isinstance(samples, list):
        return samples
    outs = [_output(ctx, s, sample_rid[s.index], sample_lp[s.index], with_text, started, None, routed) for s in samples]
    return JSONResponse(outs if many else outs[0])


def _logprob_meta(ctx: ServerContext, s: Choice, ask: LogprobAsk, with_text: bool) -> dict[str, Any]:
    """SGLang's meta_info log-prob lists for one sample (so far): triples [log-prob, token id, text or null]."""

    def triple(lp: float | None, t: int) -> list:
        return [lp, t, ctx.tokenizer.token_text(t) if with_text else None]

    def alts(pairs: list[tuple[int, float]] | None) -> list | None:
        return None if pairs is None else [triple(lp, t) for t, lp in pairs]

    def of_ids(lps: list[float] | None) -> list | None:
        return None if lps is None else [triple(lp, t) for t, lp in zip(ask.ids, lps)]

    prompt = s.prompt_ids[ask.start :]
    computed = s.prompt_logprobs  # positions start + 1 .. (None until the prefill is done, or when none)
    n = 0 if computed is None else len(computed.logprobs)
    values = [None] + (computed.logprobs if computed else []) + [None] * (len(prompt) - 1 - n)
    meta: dict[str, Any] = {
        "output_token_logprobs": [triple(lp, t) for lp, t in zip(s.logprobs, s.token_ids)],
        "input_token_logprobs": [triple(lp, t) for lp, t in zip(values, prompt)],
    }
    pad = [None] * (len(prompt) - 1 - n)
    if ask.top:
        meta["output_top_logprobs"] = [alts(a) for a in s.top_logprobs or []]
        meta["input_top_logprobs"] = [None] + [alts(a) for a in (computed.top if computed else [])] + pad
    if ask.ids:
        meta["output_token_ids_logprobs"] = [of_ids(a) for a in s.token_ids_logprobs or []]
        meta["input_token_ids_logprobs"] = [None] + [of_ids(a) for a in (computed.token_ids if computed else [])] + pad
    return meta


def _bool(v: Any, key: str) -> bool:
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false (or one per prompt), got {v!r}", param=key)
    return v


async def _stream(request, ctx, gen: Generation, rids, lps, with_text, interval, started, many, routed=False):
    async def chunks() -> AsyncIterator[bytes]:
        pending = [0] * len(gen.states)  # tokens since the sample's last event (stream_interval)
        begun = False
        try:
            async for d in gen:
                begun = True
                pending[d.index] += len(d.token_ids)
                if d.finish_reason is None and pending[d.index] < interval[d.index]:
                    continue
                pending[d.index] = 0
                s = gen.states[d.index].sample
                partial = s if d.finish_reason is not None else _so_far(gen, d.index)
                yield sse(
                    _output(
                        ctx, partial, rids[d.index], lps[d.index], with_text, started, d.index if many else None, routed
                    )
                )
        except RequestError as e:
            if not begun:
                raise
            yield sse(error_body(e))
        yield sse("[DONE]")

    return await stream_response(request, gen, chunks())


def _so_far(gen: Generation, index: int) -> Choice:
    """A sample's output so far, as a stream event shows it (the text up to what may not be a stop string)."""
    st = gen.states[index]
    s = st.sample
    return Choice(
        s.index,
        s.prompt_ids,
        st.text[: st.emitted],
        list(s.token_ids),
        list(s.logprobs),
        None,
        None,
        s.cached_tokens,
        None if s.top_logprobs is None else list(s.top_logprobs),
        None if s.token_ids_logprobs is None else list(s.token_ids_logprobs),
        s.prompt_logprobs,
    )


# ------------------------------------------------------------------ the other native routes
async def health(request: Request):
    ctx: ServerContext = request.app.state.ctx
    return empty(200 if ctx.service.loop.alive else 503)


async def health_generate(request: Request):
    """Healthy when one token can be generated (SGLang's deep health check)."""
    ctx: ServerContext = request.app.state.ctx
    # a one-token prompt any tokenizer has: its eos
    req = GenerationRequest([ctx.tokenizer.eos_token_id], SamplingParams(max_new_tokens=1), ignore_eos=True)
    try:
        gen = ctx.service.open([req])
    except RequestError as e:
        return empty(503 if e.status >= 500 else 429)
    try:
        samples = await unless_disconnected(request, gen.result())
    except (RequestError, ClientGone):
        return empty(503)
    finally:
        gen.close()
    return empty(200 if samples[0].finish_reason in ("length", "stop") else 503)


async def get_model_info(request: Request):
    ctx: ServerContext = request.app.state.ctx
    return JSONResponse(
        {
            "model_path": ctx.model_path,
            "tokenizer_path": ctx.tokenizer.name_or_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": ctx.weight_version,
            "served_model_name": ctx.model_name,
            "lora_adapters": list(ctx.adapters),
            "max_context_length": ctx.max_seq_len,
        }
    )


async def abort_request(request: Request):
    """{"rid": id} aborts that request, {"abort_all": true} every one; each answers with what it had."""
    ctx: ServerContext = request.app.state.ctx
    try:
        f = Fields(parse_body(await read_body(request)))
        rid, every = f.str("rid", None), f.bool("abort_all", False)
        f.finish()
        if (rid is None) == (not every):
            raise RequestError("give rid or abort_all=true", param="rid")
    except RequestError as e:
        return json_error(e)
    ctx.service.abort(None if every else rid)
    return empty(200)


def routes() -> list[Route]:
    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
    ]
