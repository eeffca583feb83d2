"""Rollout plugins: multi-turn (tool-use, agentic) rollouts written by the user, run against the policy.

`rollout.fn=module.path:function` replaces the loop's one-call generation. The function is called once per
sample (`rollout.samples_per_prompt` times per prompt), sync or `async def`:

    async def rollout(client: PolicyClient, record: PromptRecord) -> Sample:
        sample = client.sample                                # this sample's record, its prompt as training encodes it
        turn = await client.generate(sample.ids, stop_token_ids=[CALL])  # the policy's turn: a Sample of its tokens
        sample.add_policy(turn)                               # its tokens carry loss, with the engine's log-probs
        sample.add_environment(client.encode(tool_output))    # read by the model, masked out of the loss
        sample.add_policy(await client.generate(sample.ids))
        return sample                                         # response: what the reward scores (None: the output)

A sync function calls `client.generate_sync(...)` instead (it runs in a thread of its own). Every sample's
function runs concurrently, so the turns of all samples are batched by the engine together. `client.generate`
samples with the run's sampling parameters (rollout.temperature / top_p / top_k; at most
rollout.max_new_tokens tokens a turn unless `max_new_tokens` is given; stopping at the tokenizer's eos when
rollout.stop_at_eos), seeded per sample and turn (a resumed run redraws the same samples). The log-probs a
turn returns are the engine's, in the engine's convention (log pi(token | context) at the run's
temperature): the trainer compares them with its own (TIS / MIS, train_rollout_logprob_abs_diff), so a
plugin must pass them on untouched, and must feed the model exactly the ids it trains on (`sample.ids`),
never re-tokenized text. `client.sample` is the driver's own record of the sample (`miles_k3.data.sample.Sample`,
its prompt, label and place in its group set): the function fills and returns it, so whatever per-token fields
the engine returns with a turn ride along to the trainer.

The client (`rollout.client`): "engine" talks to the colocated engine in-process through
`rollout.server.generation.GenerationService` (the server's own client: continuous batching on the engine
loop thread); "http" starts `miles-serve`'s app over the same engine on 127.0.0.1 for the step and samples
through its SGLang-native `POST /generate` (`client.base_url` is there for agent code that speaks the
OpenAI API: model "policy" is the adapter being trained).

With a tokenizer that speaks K3's chat (`miles_k3.data.k3_chat`), each turn a client returns carries its reply
parsed from its tokens: `turn.response` (the response channel), `turn.reasoning` (the think channel) and
`turn.tool_calls` (`ToolCall`s: `name`, `arguments` JSON, `args()`); `client.chat` is the codec, whose
`continuation(messages)` gives the environment tokens after a reply (tool results, then the next generation
prompt), and the run's stop is the checkpoint's end-of-turn token under data.chat_template=k3:

    turn = await client.generate(sample.ids)
    sample.add_policy(turn)
    results = [{"role": "tool", "name": c.name, "content": run_tool(c.name, c.args())} for c in turn.tool_calls]
    sample.add_environment(client.chat.continuation(results))

A sample whose every response token is masked (or which has none) carries no signal: the loop drops it and
counts it (`samples_all_masked`). A function that raises, or returns something other than its client's
`sample` filled validly, stops the run with `RolloutPluginError` naming the function and the sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from miles_k3.data import PromptRecord
from miles_k3.data.k3_chat import chat_of
from miles_k3.data.sample import Sample
from miles_k3.model.routing import decode_table
from rollout.request import SamplingParams

if TYPE_CHECKING:
    from miles_k3.data.tokenizers import Tokenizer

ADAPTER = "policy"  # the engine's adapter slot the trainer syncs (rollout_worker.ADAPTER)
CLIENTS = ("engine", "http")


class RolloutPluginError(RuntimeError):
    """A rollout function raised, or returned an invalid trajectory."""


@dataclass(frozen=True)
class RolloutJob:
    """One sample to roll out: its prompt record, the driver's record of the sample (prompt ids set, no
    output yet), and its sampling."""

    record: PromptRecord
    sample: Sample
    params: SamplingParams  # the run's, with this sample's seed and stop tokens


class RolloutFn(NamedTuple):
    name: str
    fn: Callable[..., Any]
    is_async: bool


def load_rollout_fn(ref: str) -> RolloutFn:
    """Resolve a "module.path:function" reference (the reward plugins' loader) and check that it can be called
    as fn(client, record); ValueError naming the reference."""
    from miles_k3.rewards.plugin import is_async, load_by_path

    fn = load_by_path(ref, what="rollout function")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ValueError(f"rollout function {ref!r} is a generator; it must return its client.sample")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None  # some C callables have no signature; the call itself will tell
    if signature is not None:
        try:
            signature.bind(object(), object())
        except TypeError:
            raise ValueError(
                f"rollout function {ref!r} must accept two positional arguments (client, record); "
                f"its signature is {signature}"
            ) from None
    return RolloutFn(ref, fn, is_async(fn))


def turn_seed(seed: int | None, turn: int) -> int | None:
    """A distinct, reproducible seed per turn of a seeded sample."""
    return None if seed is None else (seed * 1_000_003 + turn + 1) % (1 << 62)


class PolicyClient:
    """The policy as a rollout function sees it (module docstring). One per sample; `generate` is awaited on
    the rollout's event loop, `generate_sync` called from the sync function's own thread."""

    def __init__(self, job: RolloutJob, codec: Tokenizer, loop: asyncio.AbstractEventLoop):
        self.job, self.codec, self._loop = job, codec, loop
        self.sample = job.sample  # the record the function fills and returns
        self.prompt_ids = list(job.sample.prompt_ids)
        self.eos_token_id = codec.eos_token_id
        self.chat = chat_of(codec)  # K3's chat encoding, when the tokenizer speaks it (None: it does not)
        self.turns = 0

    def encode(self, text: str) -> list[int]:
        """Text -> ids without special tokens (a tool's output)."""
        return self.codec.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt string -> ids, special tokens added as training adds them to a prompt."""
        return self.codec.encode_prompt(text)

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)

    def _params(self, max_new_tokens: int | None, stop_token_ids) -> SamplingParams:
        p = self.job.params
        stops = tuple(p.stop_token_ids) + tuple(t for t in stop_token_ids if t not in p.stop_token_ids)
        params = dataclasses.replace(
            p,
            max_new_tokens=max_new_tokens or p.max_new_tokens,
            stop_token_ids=stops,
            seed=turn_seed(p.seed, self.turns),
            return_logprobs=True,
        )
        self.turns += 1
        return params

    async def generate(
        self, ids: list[int], *, max_new_tokens: int | None = None, stop_token_ids: tuple[int, ...] | list[int] = ()
    ) -> Sample:
        """The policy's continuation of `ids` (prompt and every turn so far), ending at a stop token (kept)
        or after max_new_tokens: a Sample whose `output_ids`, `logprobs` and `finish_reason` ("stop": a stop
        token, kept as the last token | "length" | "abort") are the turn's, for `sample.add_policy`; with K3's
        chat encoding (`chat`) also its parsed reply: `response`, `reasoning`, `tool_calls`."""
        t = await self._generate(list(ids), self._params(max_new_tokens, tuple(stop_token_ids)))
        if self.chat is not None:
            self.chat.fill(t)
        return t

    def generate_sync(
        self, ids: list[int], *, max_new_tokens: int | None = None, stop_token_ids: tuple[int, ...] | list[int] = ()
    ) -> Sample:
        """`generate` for a sync rollout function (called from its thread, never from the event loop)."""
        coro = self.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _generate(self, ids: list[int], params: SamplingParams) -> Sample:
        raise NotImplementedError


def turn(
    ids: list[int], token_ids: list[int], logprobs: list[float], finish_reason: str, routed_experts=None
) -> Sample:
    """One generation as a client returns it: the context `ids`, the policy's tokens and their log-probs, and
    with rollout.record_routing every token's experts (`Sample.routed_experts`: the context's and the turn's)."""
    return Sample(
        "",
        prompt_ids=list(ids),
        output_ids=list(token_ids),
        logprobs=list(logprobs),
        loss_mask=[True] * len(token_ids),
        finish_reason=finish_reason,
        routed_experts=routed_experts,
    )


class EngineClient(PolicyClient):
    """In-process: the colocated engine through `GenerationService` (shared by every sample of the step)."""

    def __init__(self, job, codec, loop, service):
        super().__init__(job, codec, loop)
        self.service = service

    async def _generate(self, ids: list[int], params: SamplingParams) -> Sample:
        from rollout.server.generation import GenerationRequest

        # the stop tokens are the params' (eos among them when rollout.stop_at_eos), as in the single-turn loop
        req = GenerationRequest(ids, params, adapter=ADAPTER, ignore_eos=True)
        async with self.service.open([req]) as gen:
            (s,) = await gen.result()
        return turn(ids, s.token_ids, s.logprobs, s.finish_reason or "abort", s.routed_experts)


class HTTPClient(PolicyClient):
    """Over HTTP: miles-serve's SGLang-native `POST /generate` at `base_url` (input ids in, output ids and
    `meta_info.output_token_logprobs` out: the engine's log-probs, unchanged by JSON's float round trip)."""

    def __init__(self, job, codec, loop, http, base_url: str, routing: tuple[int, int] | None = None):
        """`routing`: (MoE layers, top_k) when the engine records routing: each turn asks for it
        (`return_routed_experts`)."""
        super().__init__(job, codec, loop)
        self.http, self.base_url, self.routing = http, base_url, routing

    async def _generate(self, ids: list[int], params: SamplingParams) -> Sample:
        body = {
            "input_ids": ids,
            "return_logprob": True,
            "lora_path": ADAPTER,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k or -1,
                "stop_token_ids": list(params.stop_token_ids),
                "ignore_eos": True,
                "sampling_seed": params.seed,
            },
            "return_routed_experts": self.routing is not None,
        }
        r = await self.http.post(f"{self.base_url}/generate", json=body)
        out = r.json()
        if r.status_code != 200:
            raise RuntimeError(f"POST /generate answered {r.status_code}: {out}")
        meta = out["meta_info"]
        logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        routed = None
        if self.routing is not None:  # every fed token's; the turn's last token was never fed: no record
            fed = decode_table(meta["routed_experts"], *self.routing)
            routed = torch.cat([fed, fed.new_full((1, *fed.shape[1:]), -1)])
        finish = (meta["finish_reason"] or {}).get("type", "abort")
        return turn(ids, out["output_ids"], logprobs, finish, routed)


async def run_rollouts(plugin: RolloutFn, jobs: list[RolloutJob], make_client, vocab_size: int) -> list[Sample]:
    """Every job's sample, filled, in order: all rollout functions run concurrently (sync ones in threads of
    their own), each with its own client from `make_client(job, loop)`."""
    loop = asyncio.get_running_loop()
    pool = (
        ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="rollout-fn")
        if not plugin.is_async
        else None
    )

    async def one(job: RolloutJob) -> Sample:
        where = job.sample.where
        client = make_client(job, loop)
        try:
            if plugin.is_async:
                out = await plugin.fn(client, job.record)
            else:
                out = await loop.run_in_executor(pool, plugin.fn, client, job.record)
        except Exception as e:
            raise RolloutPluginError(f"rollout.fn {plugin.name!r} raised on {where}: {type(e).__name__}: {e}") from e
        if out is not job.sample:
            got = "another Sample" if isinstance(out, Sample) else f"a {type(out).__name__}"
            raise RolloutPluginError(
                f"rollout.fn {plugin.name!r} returned {got} on {where}; it must fill and return client.sample"
            )
        try:
            out.check(vocab_size)
        except ValueError as e:
            raise RolloutPluginError(f"rollout.fn {plugin.name!r} on {where}: invalid sample: {e}") from None
        return out

    try:
        return list(await asyncio.gather(*(one(j) for j in jobs)))
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
