"""The rollout engine: continuous batching over the hybrid KDA/MLA cache, exact log-probs.

    engine = Engine(model, EngineConfig(memory_bytes=64 << 20))
    outs = engine.generate([[1, 5, 7], [1, 5, 9]], SamplingParams(temperature=0))
    rid = engine.submit([1, 5, 7], SamplingParams(max_new_tokens=16)); engine.step() ...
    for token, logprob in engine.stream([1, 5, 7], SamplingParams()): ...
    engine.submit(ids_with_pads, images=[ImageFeatures(features, content_hash)])  # or ProcessedImages + vision=

A prompt's images (`rollout.media`) replace the embeddings at its media pad tokens during prefill, and the
prefix cache keys those pads by image content, so prompts with other images share nothing past the first.

Each `step()` runs one forward: the scheduler's plan (`rollout.scheduler`) is a prefill batch (chunks of
several requests packed under the `max_prefill_tokens` budget, ending on `chunk_size` boundaries) or one
decode token for every request in the decode phase, through the decode pipeline (`rollout.decode`), which
on CUDA keeps one decode step in flight while the host does the previous one's bookkeeping. Memory and
every radix-cache handover go through the cache manager (`rollout.cache_manager`), the model through the
model runner (`rollout.model_runner`). A request's life through these parts: docs/structures.md.

A sharded engine (a model built with an `EngineTP` of size > 1, `rollout.build.build_sharded_engine`) runs
one Engine per rank as a replicated state machine: rank 0 applies each state change as a call of one of the
`REPLAYED` methods and logs it, the log is broadcast before its next step (adapter calls at once), and the
other ranks replay the calls by name in `follow()` (`miles_k3.rpc`; `rollout.parallel`, "One decision per
step").
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from miles_k3 import rpc
from miles_k3.model.modeling import K3ForCausalLM
from miles_k3.offload import Parked
from rollout import noise
from rollout.cache_manager import CacheManager, Running
from rollout.config import EngineConfig
from rollout.decode import DecodePipeline, DecodeStrategy, OneToken
from rollout.forward import DecodeGraphs
from rollout.lora import AdapterPool
from rollout.media import Image, MediaEncoder, PromptMedia, packed_media
from rollout.memory import KDAStatePool, KVPagePool
from rollout.model_runner import ModelRunner
from rollout.parallel import EngineTP
from rollout.request import (
    Completion,
    FinishReason,
    PromptLogprobs,
    Request,
    SamplingParams,
    TokenEvent,
    next_request_id,
)
from rollout.sampler import (
    hand_alternatives,
    prompt_alternatives,
    sample,
    sample_alternatives,
    unpack_alternatives,
)
from rollout.scheduler import Scheduler
from rollout.transfer import to_device


def strategy_for(runner: ModelRunner, config) -> DecodeStrategy:
    """The engine's decode strategy for `config` (an EngineConfig): `OneToken`, or `SpecDecode` when
    `speculation` is a `rollout.spec.SpecConfig`."""
    if config.speculation is None:
        return OneToken(runner)
    from rollout.spec.config import SpecConfig  # imported when asked: a plain engine never loads rollout.spec
    from rollout.spec.strategy import SpecDecode

    if not isinstance(config.speculation, SpecConfig):
        raise ValueError(
            f"EngineConfig.speculation must be a rollout.spec.SpecConfig or None, got "
            f"{type(config.speculation).__name__}"
        )
    return SpecDecode(runner, config.speculation)


class Engine:
    # the calls rank 0 of a sharded engine logs and the other ranks replay (`follow`): every state change
    REPLAYED = frozenset(
        {
            "_enqueue",
            "_step",
            "_abort",
            "_add_adapter",
            "_update_adapter",
            "_remove_adapter",
            "_flush_cache",
            "_release_memory",
            "_resume_memory",
        }
    )

    def __init__(
        self,
        model: K3ForCausalLM,
        config: EngineConfig,
        adapters: AdapterPool | None = None,
        *,
        vision: torch.nn.Module | None = None,
        media_token_id: int | None = None,
    ):
        """`vision`: the model that encodes `ProcessedImage`s (`K3VisionModel`; without it requests bring
        `ImageFeatures`). `media_token_id`: the prompt token whose embeddings image features replace (default:
        the checkpoint config's `media_placeholder_token_id`; a sharded engine's ranks take rank 0's features)."""
        self.model, self.config, self.adapters = model, config, adapters
        tp = self.tp = model.model.tp
        if tp.size > 1 and not isinstance(tp, EngineTP):
            raise ValueError("a tensor-parallel engine needs a model built with rollout.parallel.EngineTP")
        if config.dcp_size != getattr(tp, "dcp_size", 1):
            raise ValueError(
                f"EngineConfig.dcp_size={config.dcp_size}, but the model was built for DCP "
                f"{getattr(tp, 'dcp_size', 1)} (build_engine_model's tp=EngineTP(dcp_size=...))"
            )
        if tp.size > 1 and tp.broadcast_object(config) != config:
            raise ValueError(f"rank {tp.rank}: EngineConfig differs from rank 0's; build every rank alike")
        self.runner = ModelRunner(model, config, adapters)  # checks the model-side settings first
        # rank 0 of a sharded engine logs its calls for the other ranks, which replay them (`follow`)
        self.channel = rpc.Leader(tp.transport(self.runner.device)) if tp.size > 1 and tp.is_leader else None
        if media_token_id is None:
            media_token_id = model.config.media_placeholder_token_id
        self.media = MediaEncoder(
            vision, media_token_id, model.config.hidden_size, self.runner.device, self.runner.dtype
        )
        self.memory = CacheManager(model.config, config, self.runner.dtype, self.runner.device, tp_size=tp.size)
        self.runner.use_pools(self.memory.kv, self.memory.states)
        strategy = strategy_for(self.runner, config)
        self.scheduler = Scheduler(config, self.memory, lookahead=strategy.lookahead)
        overlap = config.overlap == "on" or (config.overlap == "auto" and self.runner.device.type == "cuda")
        self.decoder = DecodePipeline(strategy, self.scheduler, self.memory, self._append, overlap)
        self._events: dict[int, list[TokenEvent]] = {}  # submitted with stream=True: not yet taken
        self._ended: set[int] = set()  # streamed requests that finished: take_tokens hands over the rest
        self._completed: list[Completion] = []
        self._parked: Parked | None = None  # the weights, while `release_memory(weights=True)` holds them

    @property
    def overlap(self) -> bool:
        """Whether decode steps overlap (`EngineConfig.overlap` resolved for this device)."""
        return self.decoder.overlap

    @property
    def kv(self) -> KVPagePool | None:
        """The KV page pool (None while the memory is released)."""
        return self.memory.kv

    @property
    def states(self) -> KDAStatePool | None:
        """The KDA state slot pool (None while the memory is released)."""
        return self.memory.states

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode CUDA graphs (None: decode runs eagerly). Built and dropped with the pools."""
        return self.runner.graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        # the CPU tests' way in: graphs at padded shapes without capture (`DecodeGraphs(capture=False)`)
        self.runner.graphs = graphs

    # -------------------------------------------------------------- adapters
    def add_adapter(self, name: str, tensors: dict[str, torch.Tensor], alpha: float | None = None) -> None:
        """Load an adapter (the trainer's full tensors: a sharded engine's ranks each copy in their slices)."""
        self._caller()
        self._apply("_add_adapter", name, tensors, alpha, now=True)

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """New adapter weights (full tensors), copied in place. Between batches only: every cached prefix
        computed with the old weights is stale and is dropped."""
        self._caller()
        self._need_adapters()
        s = self.scheduler
        if any(r.adapter == name for r in s.waiting) or any(r.req.adapter == name for r in s.running):
            raise RuntimeError(f"update_adapter({name!r}) while requests using it are in flight")
        self._apply("_update_adapter", name, tensors, now=True)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter: its slot is zeroed and freed, its cached prefixes dropped. Refused (RuntimeError)
        while requests using it are in flight; ValueError for a name not loaded."""
        self._caller()
        self._need_adapters().slot_of(name)
        s = self.scheduler
        if any(r.adapter == name for r in s.waiting) or any(r.req.adapter == name for r in s.running):
            raise RuntimeError(f"remove_adapter({name!r}) while requests using it are in flight")
        self._apply("_remove_adapter", name, now=True)

    def set_adapter_shards(self, name: str, tensors: dict[str, torch.Tensor], alpha: float | None = None) -> None:
        """Load or update `name` from this rank's own blocks (each tensor exactly `AdapterPool.local_boxes`'s
        region of the full one), on every rank of a sharded engine at once and outside the leader's log: each
        rank received its blocks from the trainer ranks that own them (`miles_k3.trainer.adapter_sync`), none
        from rank 0. Only while no rank is inside `follow()` and no request is in flight (the scheduler is
        replicated, so every rank sees the same); every rank then takes the same slot and drops the same
        cached prefixes."""
        pool = self._need_adapters()
        s = self.scheduler
        if s.waiting or s.running:
            raise RuntimeError(f"set_adapter_shards({name!r}) while requests are in flight")
        if name in pool.names:
            pool.update_adapter(name, tensors, local=True)
            self.decoder.settle()
            self.memory.drop_tree(name)
        else:
            pool.add_adapter(name, tensors, alpha, local=True)

    def _remove_adapter(self, name: str) -> None:
        self.decoder.settle()  # a step in flight of finished requests may still hold snapshots in its tree
        self._need_adapters().remove_adapter(name)
        if self.memory.kv is not None:
            self.memory.drop_tree(name)

    def flush_cache(self) -> None:
        """Evict every cached prefix (KV pages and KDA checkpoints of every tree). Only while no request is
        waiting or running (RuntimeError otherwise): then both pools are back to full."""
        self._caller()
        if self.has_work():
            raise RuntimeError("flush_cache() with requests in flight; finish or abort them first")
        self._apply("_flush_cache")

    def _flush_cache(self) -> None:
        self.decoder.settle()
        if self.memory.kv is not None:
            for name in list(self.memory.caches):
                self.memory.drop_tree(name)

    def pool_stats(self) -> dict[str, int]:
        """Occupancy now: KV pages and KDA state slots in use (by requests or the prefix trees) and in all, the
        pages and slots the trees hold, running and waiting requests (all zeros but the counts while the memory
        is released)."""
        kv, states, s = self.memory.kv, self.memory.states, self.scheduler
        out = {"running": len(s.running), "waiting": len(s.waiting)}
        if kv is None:
            return {**out, "kv_pages_used": 0, "kv_pages_total": 0, "kda_slots_used": 0, "kda_slots_total": 0}
        pages, slots = kv.allocator, states.allocator
        return {
            **out,
            "kv_pages_used": pages.capacity - pages.num_free,
            "kv_pages_total": pages.capacity,
            "kda_slots_used": slots.capacity - slots.num_free,
            "kda_slots_total": slots.capacity,
            "tree_pages": sum(len(c.owned_pages()) for c in self.memory.caches.values()),
            "tree_slots": sum(len(c.owned_slots()) for c in self.memory.caches.values()),
        }

    def _add_adapter(self, name: str, tensors: dict[str, torch.Tensor], alpha: float | None) -> None:
        self._need_adapters().add_adapter(name, tensors, alpha)

    def _update_adapter(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self._need_adapters().update_adapter(name, tensors)
        self.memory.drop_tree(name)

    def _apply(self, name: str, *args, now: bool = False):
        """Run the state change `name(*args)` here, then log it for a sharded engine's other ranks (only a
        call that succeeded here reaches them: they receive good tensors only); `now`: send the log at once
        (adapter tensors), else with the next step."""
        out = getattr(self, name)(*args)
        if self.channel is not None:
            self.channel.record(name, *args)
            if now:
                self.channel.flush()
        return out

    def _need_adapters(self) -> AdapterPool:
        if self.adapters is None:
            raise ValueError("this engine was built without an adapter pool")
        return self.adapters

    # -------------------------------------------------------------------- API
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        adapter: str | None = None,
        stream: bool = False,
        images: list[Image] | None = None,
    ) -> int:
        """Queue a request; returns its id. Bad requests raise ValueError and leave the engine untouched.
        With `stream`, the engine keeps the request's tokens for `take_tokens` / `take_events`. `images`: the
        prompt's images in order (`ImageFeatures` or `ProcessedImage`), covering its media pad tokens in order
        (`rollout.media`); an image's features are computed once while requests share them."""
        self._caller()
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt_ids contains a token id outside [0, {vocab})")
        if len(prompt_ids) + params.max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"max_seq_len ({self.config.max_seq_len})"
            )
        pages = -(-(len(prompt_ids) + params.max_new_tokens) // self.config.page_size)
        if pages > self.memory.sizes.num_pages:
            raise ValueError(
                f"request needs {pages} KV pages but the pool holds {self.memory.sizes.num_pages}; "
                "raise memory_bytes or shorten the request"
            )
        vocab_checks = [("top_logprobs", params.top_logprobs > vocab)]
        vocab_checks.append(("token_ids_logprob", any(t >= vocab for t in params.token_ids_logprob)))
        for name, bad in vocab_checks:
            if bad:
                raise ValueError(f"SamplingParams.{name} reaches past the vocabulary ({vocab})")
        if params.logprob_start_len >= len(prompt_ids):
            raise ValueError(
                f"SamplingParams.logprob_start_len ({params.logprob_start_len}) must be < the prompt's length "
                f"({len(prompt_ids)})"
            )
        if adapter is not None:
            if self.adapters is None:
                raise ValueError(f"unknown adapter {adapter!r}: this engine has no adapter pool")
            self.adapters.slot_of(adapter)  # ValueError for an unknown name
        media = self.media.place(prompt_ids, images)  # the last check: it may run the vision model
        # the noise's seed: the request's (any integer, folded into the hash's range), or drawn from torch's
        # stream here; every rank of a sharded engine gets rank 0's
        seed = int(torch.randint(0, noise.MAX_SEED, (1,))) if params.seed is None else params.seed % noise.MAX_SEED
        request_id = next_request_id()
        # the followers take rank 0's image features (no vision model there), as (features, key base) pairs
        self._apply(
            "_enqueue",
            prompt_ids,
            params,
            adapter,
            request_id,
            seed,
            None if media is None else [tuple(image) for image in media.images],
        )
        if stream:
            self._events[request_id] = []
        return request_id

    def _enqueue(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        request_id: int,
        seed: int,
        images: list[tuple[torch.Tensor, int]] | None,
    ) -> None:
        """Queue a checked request (`submit`'s state change, replayed as is by a sharded engine's ranks)."""
        media = None if images is None else PromptMedia(prompt_ids, self.media.pads(prompt_ids), images)
        req = Request(prompt_ids, params, adapter, request_id=request_id, media=media)
        req.seed = seed
        if params.logprob_start_len >= 0:
            req.prompt_lp = PromptLogprobs(
                params.logprob_start_len,
                top=[] if params.top_logprobs else None,
                token_ids=[] if params.token_ids_logprob else None,
            )
            if params.logprob_start_len == 0:  # position 0 has no distribution before it
                _add_prompt_position(req.prompt_lp, None, (None, None))
        self.scheduler.add(req)

    def take_tokens(self, request_id: int) -> list[tuple[int, float]]:
        """The (token, log-prob) pairs a request submitted with `stream=True` sampled since the last call (in
        order, [] for any other id). Once it has finished (its Completion came out of `step` or `abort`), the
        call hands over the rest and the engine forgets the request."""
        return [(e.token, e.logprob) for e in self.take_events(request_id)]

    def take_events(self, request_id: int) -> list[TokenEvent]:
        """`take_tokens` with each token's alternatives and, on the first, the prompt log-probs (`TokenEvent`)."""
        if request_id in self._ended:
            self._ended.discard(request_id)
            return self._events.pop(request_id, [])
        events = self._events.get(request_id)
        if not events:
            return []
        self._events[request_id] = []
        return events

    def abort(self, request_id: int) -> Completion | None:
        self._caller()
        return self._apply("_abort", request_id)

    def _abort(self, request_id: int) -> Completion | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        self.decoder.settle()  # an in-flight step of only that request is read back, its slots freed
        return self._complete(req, FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        adapter: str | None | list[str | None] = None,
        images: list[list[Image] | None] | None = None,
    ) -> list[Completion]:
        """Run a batch to completion; completions in prompt order. `params` and `adapter` may be per prompt;
        `images`, when given, is per prompt (None or [] for a text prompt)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        alist = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images must hold one entry per prompt ({len(prompts)}), got {len(images)}")
        ilist = images if images is not None else [None] * len(prompts)
        ids = [self.submit(p, sp, a, images=im) for p, sp, a, im in zip(prompts, plist, alist, ilist)]
        done: dict[int, Completion] = {}
        while len(done) < len(ids):
            for c in self.step():
                done[c.request_id] = c
        return [done[i] for i in ids]

    def stream(
        self, prompt_ids: list[int], params: SamplingParams | None = None, images: list[Image] | None = None
    ) -> Iterator[tuple[int, float]]:
        """Yield (token, log-prob) as they are sampled, stepping the engine (other requests progress too)."""
        rid = self.submit(prompt_ids, params, stream=True, images=images)
        try:
            while True:
                finished = {c.request_id for c in self.step()}
                yield from self.take_tokens(rid)
                if rid in finished:
                    return
        finally:  # an abandoned stream's request runs on, unrecorded
            self._events.pop(rid, None)
            self._ended.discard(rid)

    # ------------------------------------------------------------------- step
    def step(self) -> list[Completion]:
        """One forward: a prefill batch or a decode batch. Returns the requests that finished. With overlap
        a decode step is only enqueued: its tokens (and the requests it finishes) arrive with the next call,
        which enqueues the following decode first."""
        self._caller()
        if self.memory.kv is None:
            raise RuntimeError("engine memory is released; call resume_memory() first")
        if self.channel is not None:  # sent before it runs: the step's collectives need every rank inside it
            return self.channel.call(self, "_step")
        return self._step()

    def _step(self) -> list[Completion]:
        self._completed = []
        if not self.decoder.advance():  # True: decode k+1 enqueued, step k read back
            plan = self.scheduler.schedule()
            if plan.prefill:
                self._prefill(plan.prefill)
            else:
                self.decoder.run(plan.decode)
        return self._completed

    def _prefill(self, plan: list[tuple[Running, int]]) -> None:
        """One packed forward over the planned chunks, with the rows of the images whose pads they cover (a
        chunk may start or end inside an image); each chunk's prefix goes to the radix cache, and a request
        whose prompt is now complete samples its first token."""
        batch = [r for r, _ in plan]
        lengths = [end - r.pos for r, end in plan]
        media = packed_media([(r.req.media, r.pos, end) for r, end in plan], self.runner.device)
        ids = [t for r, end in plan for t in r.tokens[r.pos : end]]
        # media only when there is some: a text prefill's call is the one it always was; logits at every new
        # token only when a request computes prompt log-probs in this chunk (`_prompt_logprobs`)
        extra = {} if media is None else {"media": media}
        every = any(_prompt_rows(r, end) for r, end in plan)
        if every:
            extra["every_token"] = True
        logits = self.decoder.strategy.prefill(
            lambda: self.runner.forward(batch, ids, lengths, **extra),
            batch,
            [(r.pos, end) for r, end in plan],
        )
        if every:
            logits = self._prompt_logprobs(plan, logits)
        for r, end in plan:
            r.pos = end
        self.memory.donate(batch)
        done = [i for i, (r, _) in enumerate(plan) if r.pos == len(r.tokens)]
        if done:
            rows = done if len(done) < len(plan) else slice(None)
            batch = [plan[i][0] for i in done]
            params = [r.req.params for r in batch]
            if any(p.alternatives for p in params):
                tokens, logps = self._sample_alternatives(logits[rows], batch)
            else:
                tokens, logps = sample(
                    logits[rows], params, [r.req.seed for r in batch], [r.pos for r in batch]
                )  # the new token's position: r.pos = len(r.tokens)
            self._append(batch, [[t] for t in tokens], [[lp] for lp in logps])

    def _sample_alternatives(self, logits: torch.Tensor, batch: list[Running]) -> tuple[list[int], list[float]]:
        """`sample` of a prefill's first tokens, with the alternatives of the rows that ask set on their
        requests (`Request.step_alternatives`) for `_append`."""
        params = [r.req.params for r in batch]
        keys = to_device([[r.req.seed for r in batch], [r.pos for r in batch]], logits.device, torch.long)
        tokens, logps, alt = sample_alternatives(logits, params, keys)
        hand_alternatives([r.req for r in batch], alt.tolist(), self.model.config.vocab_size)
        return [int(t) for t in tokens.tolist()], [float(lp) for lp in logps.tolist()]

    def _prompt_logprobs(self, plan: list[tuple[Running, int]], logits: torch.Tensor) -> torch.Tensor:
        """From a prefill's logits at every new token [sum lengths, V]: each asking request's prompt log-probs
        for the positions this chunk computes the row before (`Request.prompt_lp`); returns the logits at each
        request's last new token [B, V], what the prefill samples from. Runs before the plan's `pos` advance.
        A position whose row a prefix hit skipped gets None (admission prevents it: `Scheduler._admit`; only
        unified memory's re-match after blocks moved can hit deeper)."""
        ends, at = [], 0
        entries: list[tuple[Request, int | None]] = []  # in position order per request; None: skipped
        for r, end in plan:
            entries += [(r.req, at + q - 1 - r.pos if q > r.pos else None) for q in _prompt_rows(r, end)]
            at += end - r.pos
            ends.append(at - 1)
        asked = [(req, row) for req, row in entries if row is not None]
        values: list[tuple] = []
        if asked:
            params = [req.params for req, _ in asked]
            index = to_device([row for _, row in asked], logits.device, torch.long)
            picked, alt = prompt_alternatives(logits[index], params, _targets(entries))
            both = (
                unpack_alternatives(alt.tolist(), params, self.model.config.vocab_size)
                if alt is not None
                else [(None, None)] * len(asked)
            )
            values = list(zip(picked.tolist(), both))
        it = iter(values)
        for req, row in entries:
            lp, extra = (None, (None, None)) if row is None else next(it)
            _add_prompt_position(req.prompt_lp, lp, extra)
        return logits[to_device(ends, logits.device, torch.long)]

    def _append(self, batch: list[Running], tokens: list[list[int]], logps: list[list[float]]) -> None:
        """Each row's new tokens, in order, up to a stop token or the length limit (the request finishes)."""
        for r, toks, lps in zip(batch, tokens, logps):
            req = r.req
            alternatives, req.step_alternatives = req.step_alternatives, None
            for i, (tok, lp) in enumerate(zip(toks, lps)):
                top, ids = alternatives[i] if alternatives else (None, None)
                if req.params.top_logprobs:
                    req.top_logprobs.append(top)
                if req.params.token_ids_logprob:
                    req.token_ids_logprobs.append(ids)
                first = not req.output_ids
                req.output_ids.append(tok)
                req.logprobs.append(lp)
                r.tokens.append(tok)
                if req.request_id in self._events:
                    prompt = req.prompt_lp if first else None
                    self._events[req.request_id].append(TokenEvent(tok, lp, top, ids, prompt))
                reason = (
                    FinishReason.STOP
                    if tok in req.params.stop_token_ids
                    else FinishReason.LENGTH
                    if len(req.output_ids) >= req.params.max_new_tokens
                    else None
                )
                if reason is not None:
                    if self.runner.routing is not None:  # read while the request still holds its pages
                        req.routed_experts = self.runner.routed_experts(r)
                    self.scheduler.finish(r)
                    self._completed.append(self._complete(req, reason))
                    break

    def _complete(self, req: Request, reason: FinishReason) -> Completion:
        req.finish_reason = reason
        if req.request_id in self._events:
            self._ended.add(req.request_id)
        return req.completion()

    def check_invariants(self) -> None:
        """Rebuild the accounting: every page / slot is in exactly one place (tree, a request, free)."""
        self.memory.check(self.scheduler.running, self.decoder.pending_slots())

    # ------------------------------------------------------------ colocation
    def counters(self) -> dict[str, int]:
        """Since the engine was built, across `release_memory`: decode CUDA graphs captured and replayed
        (0 without graphs) and requests retracted."""
        captures, replays = self.runner.graph_counts()
        return {"graph_captures": captures, "graph_replays": replays, "retractions": self.scheduler.num_retractions}

    def release_memory(self, weights: bool = False) -> None:
        """Drop the KV and state pools (and the prefix cache) so a colocated trainer can use the memory; with
        `weights` also park the model's weights on the host (`miles_k3.offload.Parked`) until
        `resume_memory`. Only between batches: no request may be waiting or running."""
        self._caller()
        if self.has_work():
            raise RuntimeError("release_memory() with requests in flight; finish or abort them first")
        self._apply("_release_memory", weights)

    def _release_memory(self, weights: bool = False) -> None:
        self.runner.release_pools()
        self.memory.release_pools()
        if weights and self._parked is None:
            self._parked = Parked([*self.model.parameters(), *self.model.buffers()])
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Take back what `release_memory` gave up (a no-op for what it kept)."""
        self._caller()
        self._apply("_resume_memory")

    def _resume_memory(self) -> None:
        if self._parked is not None:
            self._parked.restore()
            self._parked = None
        if self.memory.kv is None:
            self.memory.resume_pools()
            self.runner.use_pools(self.memory.kv, self.memory.states)

    # ------------------------------------------------------------- sharding
    @property
    def is_leader(self) -> bool:
        """Whether this process drives the engine: always, except on the ranks > 0 of a sharded engine."""
        return self.tp.size == 1 or self.tp.is_leader

    def _caller(self) -> None:
        if not self.is_leader:
            raise RuntimeError(f"rank {self.tp.rank} of a sharded engine follows rank 0: call follow(), not the API")

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' `follow()` (calls logged and not yet sent go first). They may `follow()`
        again for rank 0's next calls (the RL loop runs one such session per call: `miles_k3.trainer.backends`)."""
        self._caller()
        if self.channel is not None:
            self.channel.stop()

    def follow(self) -> None:
        """Ranks > 0 of a sharded engine: replay rank 0's calls (`REPLAYED`), step for step, until it calls
        `stop_followers()`. Request ids, sampling seeds, image features and adapter tensors come with the
        calls."""
        if self.is_leader:
            raise RuntimeError("follow() is for the ranks > 0 of a sharded engine")
        rpc.follow(self, self.tp.transport(self.runner.device))


def _prompt_rows(r: Running, end: int) -> list[int]:
    """The prompt positions q whose log-prob is due once r's prefill chunk [r.pos, end) is computed: those not
    yet done (from `SamplingParams.logprob_start_len`, position 0 set at submit) whose row q - 1 is before end."""
    first = r.req.prompt_logprob_next
    if first is None:
        return []
    return list(range(max(first, 1), min(end, len(r.req.prompt_ids) - 1) + 1))


def _targets(entries: list[tuple[Request, int | None]]) -> list[int]:
    """The prompt token at each computed entry's position (entries in position order per request, from its
    `prompt_logprob_next`)."""
    nxt: dict[int, int] = {}
    out = []
    for req, row in entries:
        q = nxt.get(req.request_id, req.prompt_logprob_next)
        nxt[req.request_id] = q + 1
        if row is not None:
            out.append(req.prompt_ids[q])
    return out


def _add_prompt_position(
    lp: PromptLogprobs, value: float | None, extra: tuple[list[tuple[int, float]] | None, list[float] | None]
) -> None:
    lp.logprobs.append(value)
    if lp.top is not None:
        lp.top.append(extra[0])
    if lp.token_ids is not None:
        lp.token_ids.append(extra[1])
