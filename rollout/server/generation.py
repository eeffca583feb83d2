"""Sampling as the APIs see it: requests of n samples, stop strings, text, admission. No HTTP here.

`GenerationService` is the server's one way into the engine, and the in-process "client for the policy":
both HTTP APIs build `GenerationRequest`s and read `Delta`s / `Choice`s, and so can any coroutine in the
server's process (a multi-turn rollout that keeps token ids and log-probs as the engine produced them).

    service = GenerationService(EngineLoop(engine), tokenizer, capacity=320)
    async with service.open([GenerationRequest(ids, SamplingParams(max_new_tokens=8), n=2)]) as gen:
        async for delta in gen: ...          # or: samples = await gen.result()

What the engine does not know, this layer adds: the tokenizer's eos as a stop token (unless
`ignore_eos`), stop strings matched on the decoded text (the request is aborted in the engine as soon as
one matches; its tokens end with the one that completed the match), incremental text, and admission:
at most `capacity` samples in flight (running or waiting for a decode slot), past which `open` raises
`Overloaded` instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import AsyncIterator

from rollout.request import FinishReason, PromptLogprobs, SamplingParams
from rollout.server.engine_loop import EngineLoop, Ticket, Update
from rollout.server.tokenization import ServerTokenizer


class RequestError(Exception):
    """A request the server refuses; `status` is its HTTP status (4xx, or 503 while it cannot serve)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


class Overloaded(RequestError):
    def __init__(self, message: str):
        super().__init__(message, status=429, kind="rate_limit_error", code="rate_limit_exceeded")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and how to sample `n` continuations of it."""

    prompt_ids: list[int]
    params: SamplingParams  # as the engine takes them; the eos is added here unless ignore_eos
    n: int = 1  # samples; sample i with `params.seed` set draws from seed + i
    adapter: str | None = None  # a loaded adapter's name; None: the base
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded text
    keep_stop: bool = False  # keep a matched stop string in the text (SGLang's no_stop_trim)
    ignore_eos: bool = False  # do not stop at the tokenizer's eos
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # the prompt's images in pad order (ProcessedImages, `rollout.server.images`): the engine encodes each
    # content once for all n samples
    images: tuple = ()


@dataclass
class Delta:
    """New output of one sample: `index` is its position over all the request's samples (prompt-major)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None  # "stop" | "length" | "abort", on the sample's last delta
    matched: int | str | None = None  # the stop token id or stop string that ended it
    # per token, with SamplingParams.top_logprobs / token_ids_logprob: top (id, log-prob) pairs, given ids' log-probs
    top: list[list[tuple[int, float]]] | None = None
    ids: list[list[float]] | None = None


@dataclass
class Choice:
    """One finished sample of a request (a choice, in OpenAI's words; not `miles_k3.data.sample.Sample`, the
    trainer's record of a sample)."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    cached_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, with SamplingParams.top_logprobs
    token_ids_logprobs: list[list[float]] | None = None  # per token, with SamplingParams.token_ids_logprob
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.logprob_start_len >= 0
    shutdown: bool = False  # finish_reason "abort" because the server is going away (not a caller's abort)
    routed_experts: object | None = None  # with record_routing: Completion.routed_experts, once finished


class _SampleState:
    """Turns one sample's engine updates into deltas: decodes, matches stop strings, holds back text that
    could be the start of a stop string until it is known not to be."""

    def __init__(self, index: int, req: GenerationRequest, prompt: int, nth: int, tokenizer: ServerTokenizer):
        self.sample = Choice(index, req.prompt_ids)
        if req.params.top_logprobs:
            self.sample.top_logprobs = []
        if req.params.token_ids_logprob:
            self.sample.token_ids_logprobs = []
        self.req, self.prompt, self.nth = req, prompt, nth  # the nth sample of the request's prompt-th prompt
        self.decoder = tokenizer.decoder(req.skip_special_tokens)
        self.text = ""  # decoded so far (before any stop match)
        self.emitted = 0  # characters of `text` already delivered
        self.searched = 0  # characters of `text` already searched for stop strings (each new token: its tail)
        self.ticket: Ticket | None = None

    @property
    def done(self) -> bool:
        return self.sample.finish_reason is not None

    def feed(self, update: Update) -> Delta | None:
        if self.done:
            return None  # tokens the engine made after a stop string matched (before our abort landed)
        s = self.sample
        new_ids, new_lps = [], []
        for tok, lp in zip(update.token_ids, update.logprobs):
            new_ids.append(tok)
            new_lps.append(lp)
            self.text += self.decoder.push([tok])
            if self._match_stop():
                break
        s.token_ids += new_ids
        s.logprobs += new_lps
        top = None if update.top is None else update.top[: len(new_ids)]
        ids = None if update.ids is None else update.ids[: len(new_ids)]
        if s.top_logprobs is not None and top is not None:
            s.top_logprobs += top
        if s.token_ids_logprobs is not None and ids is not None:
            s.token_ids_logprobs += ids
        if update.prompt is not None and s.prompt_logprobs is None:
            s.prompt_logprobs = update.prompt
        if update.finish is not None and not self.done:
            self.text += self.decoder.finish()
            if not self._match_stop():
                s.finish_reason = "abort" if update.finish == FinishReason.ABORT else update.finish.value
                s.matched = s.token_ids[-1] if update.finish == FinishReason.STOP else None
                s.shutdown = update.finish == FinishReason.ABORT and update.shutdown
        if update.finish is not None:
            s.cached_tokens, s.routed_experts = update.cached_tokens, update.routed_experts
        end = len(self.text) if self.done else len(self.text) - self._holdback()
        piece, self.emitted = self.text[self.emitted : end], max(self.emitted, end)
        if self.done:
            s.text = self.text
        if not (piece or new_ids or self.done):
            return None
        return Delta(s.index, piece, new_ids, new_lps, s.finish_reason, s.matched, top, ids)

    def _match_stop(self) -> bool:
        """Finish at the earliest stop string in the text: text cut before it (or after, keep_stop). Only
        the new text and the stop-length tail before it are searched: an earlier match was found earlier."""
        best = None
        for stop in self.req.stop:
            at = self.text.find(stop, max(0, self.searched - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        self.searched = len(self.text)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.req.keep_stop else self.text[:at]
        self.sample.finish_reason, self.sample.matched = "stop", stop
        return True

    def _holdback(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.req.stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class Generation:
    """The samples of one request in flight. Iterate for `Delta`s, or await `result()`; `close()` (the
    context manager's exit) aborts whatever has not finished and frees the admission it held."""

    def __init__(self, service: GenerationService, reqs: list[GenerationRequest]):
        self.service = service
        self.queue: asyncio.Queue = asyncio.Queue()
        self.states: list[_SampleState] = []
        for p, req in enumerate(reqs):
            for nth in range(req.n):
                self.states.append(_SampleState(len(self.states), req, p, nth, service.tokenizer))
        self._closed = False

    def _start(self) -> None:
        eos = self.service.tokenizer.eos_token_id
        for st in self.states:
            req, params = st.req, st.req.params
            stops = params.stop_token_ids
            if not req.ignore_eos and eos not in stops:
                stops += (eos,)
            params = dataclasses.replace(
                params,
                stop_token_ids=stops,
                return_logprobs=True,
                seed=None if params.seed is None else params.seed + st.nth,
            )  # top_logprobs, token_ids_logprob and logprob_start_len pass through as the API set them
            st.ticket = self.service.loop.submit(
                req.prompt_ids, params, req.adapter, self.queue, st.sample.index, images=req.images
            )

    async def __aiter__(self) -> AsyncIterator[Delta]:
        pending = sum(not st.done for st in self.states)
        while pending:
            update: Update = await self.queue.get()
            st = self.states[update.index]
            if update.error is not None:
                raise RequestError(update.error, status=update.status)
            was_done = st.done
            delta = st.feed(update)
            if st.done and not was_done:
                pending -= 1
                if update.finish is None:  # a stop string matched: the engine is still generating it
                    self.service.loop.abort(st.ticket)
            if delta is not None:
                yield delta

    async def result(self) -> list[Choice]:
        async for _ in self:
            pass
        return [st.sample for st in self.states]

    def abort(self, prompts: set[int] | None = None, shutdown: bool = False) -> None:
        """Stop every unfinished sample (of the prompts at these positions; None: all): each ends with
        finish_reason "abort" (`Choice.shutdown` set with `shutdown`: the server is going away), and
        iteration still ends."""
        for st in self.states:
            if st.ticket is not None and not st.done and (prompts is None or st.prompt in prompts):
                self.service.loop.abort(st.ticket, shutdown)

    def close(self) -> None:
        """Abort what is unfinished and give back the admission. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort()
        self.service._release(self)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class GenerationService:
    def __init__(self, loop: EngineLoop, tokenizer: ServerTokenizer, *, capacity: int):
        self.loop, self.tokenizer, self.capacity = loop, tokenizer, capacity
        self.in_flight = 0  # samples admitted and not yet closed (changed on the event loop only)
        self._open: dict[Generation, list[str | None]] = {}  # open generations: each prompt's caller-given id

    def open(self, reqs: list[GenerationRequest], rids: list[str | None] | None = None) -> Generation:
        """Submit every sample of `reqs` at once, or none: Overloaded (429) when they would take the
        samples in flight past `capacity`, RequestError (503) when the engine cannot serve. `rids`: one id
        per request that `abort(rid)` can stop it by."""
        if not self.loop.alive:
            why = f": {self.loop.failure}" if self.loop.failure else ""
            raise RequestError(f"the engine is not serving{why}", status=503)
        total = sum(r.n for r in reqs)
        if total > self.capacity:
            raise RequestError(
                f"the request asks for {total} samples; this server holds at most {self.capacity} "
                "in flight (max running + max queued)",
                param="n",
            )
        if self.in_flight + total > self.capacity:
            raise Overloaded(
                f"server busy: {self.in_flight} samples in flight, {total} more asked, capacity "
                f"{self.capacity} (max running + max queued); retry later"
            )
        gen = Generation(self, reqs)
        self.in_flight += total
        self._open[gen] = list(rids) if rids is not None else [None] * len(reqs)
        gen._start()
        return gen

    def _release(self, gen: Generation) -> None:
        if self._open.pop(gen, _GONE) is not _GONE:
            self.in_flight -= len(gen.states)

    def abort(self, rid: str | None = None, shutdown: bool = False) -> int:
        """Abort the open requests with caller id `rid` (every one: None); returns how many. Each finishes
        with finish_reason "abort"; `shutdown`: because the server is going away (the APIs answer 503 then)."""
        hits = 0
        for gen, rids in list(self._open.items()):
            prompts = {i for i, r in enumerate(rids) if rid is None or r == rid}
            if prompts:
                gen.abort(prompts, shutdown)
                hits += len(prompts)
        return hits

    def shutdown(self) -> int:
        """Abort every open request because the server is going away."""
        return self.abort(None, shutdown=True)


_GONE = object()
