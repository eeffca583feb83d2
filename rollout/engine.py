"""The rollout engine: continuous batching over the hybrid KDA/MLA cache, exact log-probs.

    engine = Engine(model, EngineConfig(memory_bytes=64 << 20))
    outs = engine.generate([[1, 5, 7], [1, 5, 9]], SamplingParams(temperature=0))
    rid = engine.submit([1, 5, 7], SamplingParams(max_new_tokens=16)); engine.step() ...
    for token, logprob in engine.stream([1, 5, 7], SamplingParams()): ...

Each `step()` either runs one prefill batch (chunks of several requests packed into one forward under
the `max_prefill_tokens` budget, each chunk ending on a `chunk_size` boundary: the boundaries are where
KDA checkpoints are snapshotted and donated to the radix cache) or one decode token for every request in
the decode phase (on CUDA replayed from a CUDA graph per batch-size bucket, `rollout.forward`).

Overlap (`EngineConfig.overlap`, on by default on CUDA): a decode step is enqueued with its sampled tokens
left on the device, and the next step enqueues the following decode of the same requests, fed from those
device tokens, before the host reads the first step's tokens. So the host's bookkeeping for step k (token
appends, stop checks, radix-tree inserts) and its preparation of step k+1 (pages, layout, graph inputs) run
while the device computes. The price: a request that stops on a stop token has already been fed into one
more step, whose row is discarded (its pages and slot are freed after that step in stream order). A
request's length limit is known in advance, so it is not fed past it. Outputs are those of the plain
schedule: every request draws one sample per step from its own generator either way. Under memory pressure
the newest running request is retracted: what it computed is cached, its resources freed, and it goes
back to the front of the queue with its output so far; it finishes later, never lost or duplicated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from miles_k3.model.modeling import K3ForCausalLM
from miles_k3.model.moe import RoutedExperts
from rollout.config import EngineConfig
from rollout.forward import DecodeGraphs, model_step, prepare_model
from rollout.linears import EngineExperts
from rollout.lora import AdapterPool
from rollout.memory import IndexAllocator, KDAStatePool, KVPagePool, PoolSizes
from rollout.radix_cache import HybridRadixCache, Node
from rollout.request import Completion, FinishReason, Request, SamplingParams
from rollout.sampler import sample, sample_on_device
from rollout.state_cache import BatchLayout, PoolStateCache
from rollout.transfer import to_device


@dataclass(eq=False)
class _Running:
    req: Request
    cache: HybridRadixCache  # the prefix tree of this request's adapter
    tokens: list[int]  # prompt + outputs fed so far or pending; KV/state computed for tokens[:pos]
    slot: int
    node: Node  # locked in the radix cache
    pos: int
    pages: list[int]
    tree_pages: int = 0  # pages[:tree_pages] belong to the radix tree (locked); the rest are the request's

    @property
    def private(self) -> list[int]:
        return self.pages[self.tree_pages:]
    fork_pos: int | None = None  # chunk-aligned branch point where a prefill chunk must end (Marconi)
    generator: torch.Generator | None = None


@dataclass(eq=False)
class _DecodeLaunch:
    """A decode step whose forward and sampling are enqueued; its tokens may not be on the host yet.

    `batch[n]` was fed one token and its `pos` already advanced. `tokens` [N] (device) are the samples,
    the next step's input; `host` [2, N] float64 receives tokens and log-probs (pinned, filled
    asynchronously on CUDA; `ready` marks the copy). `snapshots` holds (request, position, checkpoint slot
    or None) for rows that reached a chunk boundary: the state was copied when the step was enqueued,
    the tree insert waits for the tokens."""

    batch: list[_Running]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    snapshots: list[tuple[_Running, int, int | None]]


class Engine:
    def __init__(self, model: K3ForCausalLM, config: EngineConfig, adapters: AdapterPool | None = None):
        self.model = model.eval()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        prepare_model(model)
        self._set_mxfp4_matmul(config.mxfp4_matmul)
        self.adapters = adapters
        self.config = config
        if config.lora_mixed == "triton" and (adapters is None or self.device.type != "cuda"):
            raise ValueError(f"lora_mixed='triton' needs an adapter pool and the model on CUDA (model on "
                             f"{self.device}, adapter pool {'given' if adapters is not None else 'missing'})")
        if adapters is not None:  # lives on the pool: engines sharing one pool share the last one's
            adapters.mixed_kernel = config.lora_mixed
        if config.compile_decode and not self._graphs_apply():
            raise ValueError("compile_decode=True compiles the CUDA-graph decode step: it needs the model on CUDA, "
                             "cuda_graphs=True and routed experts that run grouped GEMMs (bf16)")
        self.sizes = PoolSizes.from_budget(model.config, config.memory_bytes, page_size=config.page_size,
                                           state_fraction=config.state_fraction, dtype=self.dtype)
        self._build_pools()
        self.waiting: deque[Request] = deque()
        self.running: list[_Running] = []
        self._generators: dict[int, torch.Generator] = {}
        self._events: dict[int, list[tuple[int, float]]] = {}  # only for streamed requests
        self._completed: list[Completion] = []
        self.num_retractions = 0
        self._dropped_graph_counts = (0, 0)  # (captures, replays) of graphs that release_memory dropped
        self._overlap = config.overlap == "on" or (config.overlap == "auto" and self.device.type == "cuda")
        self._inflight: _DecodeLaunch | None = None  # the enqueued decode step not yet read back (overlap)

    @property
    def overlap(self) -> bool:
        """Whether decode steps overlap (`EngineConfig.overlap` resolved for this device)."""
        return self._overlap

    def _build_pools(self) -> None:
        self.kv = KVPagePool(self.model.config, self.sizes, self.dtype, self.device)
        self.states = KDAStatePool(self.model.config, self.sizes, self.dtype, self.device)
        self.graphs = DecodeGraphs(self.model, self.kv, self.states, max_batch=self.config.max_running,
                                   max_seq_len=self.config.max_seq_len, capture=True, adapters=self._adapted_pool(),
                                   compile=self.config.compile_decode) if self._graphs_apply() else None
        # One prefix tree per adapter (KV and KDA state depend on the adapter), sharing the pools.
        self.caches: dict[str | None, HybridRadixCache] = {}

    def _set_mxfp4_matmul(self, kind: str) -> None:
        # The setting lives on the model's expert modules: engines sharing one model share the last one's.
        if kind == "auto":
            kind = "triton" if self.device.type == "cuda" else "torch"
        if kind == "triton" and self.device.type != "cuda":
            raise ValueError(f"mxfp4_matmul='triton' needs the model on CUDA, it is on {self.device}")
        for m in self.model.modules():
            if isinstance(m, EngineExperts):
                m.mxfp4_matmul = kind

    def _adapted_pool(self) -> AdapterPool | None:
        return self.adapters if self.adapters is not None and self.adapters.A else None

    def _graphs_apply(self) -> bool:
        """CUDA graphs need a decode step without host syncs: routed experts have one when they run grouped
        GEMMs (`RoutedExperts.groups`; engine experts add their adapter rank), and `DecodeGraphs.usable`
        keeps batches that mix adapters eager."""
        return (self.config.cuda_graphs and self.device.type == "cuda"
                and all(m.groups(self.dtype) for m in self.model.modules() if isinstance(m, RoutedExperts)))

    def cache_for(self, adapter: str | None) -> HybridRadixCache:
        if adapter not in self.caches:
            self.caches[adapter] = HybridRadixCache(
                self.kv.allocator, self.states.allocator, page_size=self.config.page_size,
                chunk_size=self.config.chunk_size, max_checkpoints_per_path=self.config.max_checkpoints_per_path)
        return self.caches[adapter]

    def _evict_pages(self, n: int) -> int:
        return self._evict_across_trees(n, HybridRadixCache.evict_pages)

    def _evict_checkpoints(self, n: int) -> int:
        return self._evict_across_trees(n, HybridRadixCache.evict_checkpoints)

    def _evict_across_trees(self, n: int, evict) -> int:
        freed = 0
        for cache in list(self.caches.values()):
            if freed >= n:
                break
            freed += evict(cache, n - freed)
        return freed

    # -------------------------------------------------------------- adapters
    def add_adapter(self, name: str, tensors: dict[str, torch.Tensor], alpha: float | None = None) -> None:
        self._need_adapters().add_adapter(name, tensors, alpha)

    def update_adapter(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """New adapter weights, copied in place. Between batches only: every cached prefix computed with the
        old weights is stale and is dropped."""
        pool = self._need_adapters()
        if any(r.adapter == name for r in self.waiting) or any(r.req.adapter == name for r in self.running):
            raise RuntimeError(f"update_adapter({name!r}) while requests using it are in flight")
        pool.update_adapter(name, tensors)
        stale = self.caches.pop(name, None)
        if stale is not None and self.kv is not None:
            stale.evict_pages(10**18)
            stale.evict_checkpoints(10**18)

    def _need_adapters(self) -> AdapterPool:
        if self.adapters is None:
            raise ValueError("this engine was built without an adapter pool")
        return self.adapters

    # -------------------------------------------------------------------- API
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, adapter: str | None = None) -> int:
        """Queue a request; returns its id. Bad requests raise ValueError and leave the engine untouched."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt_ids contains a token id outside [0, {vocab})")
        if len(prompt_ids) + params.max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"max_seq_len ({self.config.max_seq_len})")
        pages = -(-(len(prompt_ids) + params.max_new_tokens) // self.config.page_size)
        if pages > self.sizes.num_pages:
            raise ValueError(f"request needs {pages} KV pages but the pool holds {self.sizes.num_pages}; "
                             "raise memory_bytes or shorten the request")
        if adapter is not None:
            if self.adapters is None:
                raise ValueError(f"unknown adapter {adapter!r}: this engine has no adapter pool")
            self.adapters.slot_of(adapter)  # ValueError for an unknown name
        req = Request(prompt_ids, params, adapter)
        if params.seed is not None:
            self._generators[req.request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        self.waiting.append(req)
        return req.request_id

    def abort(self, request_id: int) -> Completion | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return self._complete(req, FinishReason.ABORT)
        for r in self.running:
            if r.req.request_id == request_id:
                self._release(r)
                self._settle()
                return self._complete(r.req, FinishReason.ABORT)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 adapter: str | None | list[str | None] = None) -> list[Completion]:
        """Run a batch to completion; completions in prompt order. `params` and `adapter` may be per prompt."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        alist = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        ids = [self.submit(p, sp, a) for p, sp, a in zip(prompts, plist, alist)]
        done: dict[int, Completion] = {}
        while len(done) < len(ids):
            for c in self.step():
                done[c.request_id] = c
        return [done[i] for i in ids]

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[tuple[int, float]]:
        """Yield (token, log-prob) as they are sampled, stepping the engine (other requests progress too)."""
        rid = self.submit(prompt_ids, params)
        self._events[rid] = []
        try:
            while True:
                finished = {c.request_id for c in self.step()}
                yield from self._events[rid]
                self._events[rid] = []
                if rid in finished:
                    return
        finally:
            self._events.pop(rid, None)

    # ------------------------------------------------------------------- step
    def step(self) -> list[Completion]:
        """One forward: a prefill chunk or a decode batch. Returns the requests that finished. With overlap
        a decode step is only enqueued: its tokens (and the requests it finishes) arrive with the next call,
        which enqueues the following decode first."""
        if self.kv is None:
            raise RuntimeError("engine memory is released; call resume_memory() first")
        self._completed = []
        if (prev := self._inflight) is not None:
            self._inflight = self._continue_decode(prev)  # enqueued before prev's tokens are read
            self._resolve(prev)
            if self._inflight is not None:
                self._settle()
                return self._completed
        self._admit()
        # A prefill whose requests could not get pages retracted them: decode instead, so the running
        # requests always progress (otherwise re-admitting them each step would starve them).
        if not self._prefill():
            decoding = [r for r in self.running if len(r.tokens) - r.pos == 1]
            if decoding:
                self._decode(decoding)
        return self._completed

    def _admit(self) -> None:
        """Move waiting requests into free running slots, oldest first, restoring their cached prefix. A
        request that shares more of its prompt with a request still prefilling than the cache holds waits
        (keeping its place in the queue) until that prefill has donated the shared part: GRPO's n samples
        of a prompt, submitted together, compute the prompt once instead of n times."""
        if not self.waiting or len(self.running) >= self.config.max_running:
            return
        c = self.config.chunk_size
        # (prefix tree, first chunk of the prompt) -> requests prefilling it
        prefilling: dict[tuple[int, tuple[int, ...]], list[_Running]] = {}
        for r in self.running:
            if len(r.tokens) - r.pos > 1:
                prefilling.setdefault((id(r.cache), tuple(r.tokens[:c])), []).append(r)
        deferred: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting.popleft()
            tokens = req.all_ids
            cache = self.cache_for(req.adapter)
            m = cache.match_prefix(tokens)
            if self._prefill_to_share(tokens, m.prefix_len, prefilling.get((id(cache), tuple(tokens[:c])), ())):
                deferred.append(req)
                continue
            cache.lock(m.node)
            slot = self._alloc(self.states.allocator, 1, self._evict_checkpoints)
            if slot is None:
                cache.unlock(m.node)
                self.waiting.appendleft(req)
                break
            # copy-on-write restore, enqueued before anything can reuse the checkpoint's slot
            if m.checkpoint_slot is None:
                self.states.zero_slots(slot)
            else:
                self.states.copy_slots([m.checkpoint_slot], slot)
            req.cached_tokens = m.prefix_len
            r = _Running(req, cache, tokens, slot[0], m.node, m.prefix_len, list(m.pages), tree_pages=len(m.pages),
                         fork_pos=m.fork_pos, generator=self._generators.get(req.request_id))
            self.running.append(r)
            if len(tokens) - r.pos > 1:
                prefilling.setdefault((id(cache), tuple(tokens[:c])), []).append(r)
        self.waiting.extendleft(reversed(deferred))

    def _prefill_to_share(self, tokens: list[int], cached: int, prefillers: Iterable[_Running]) -> bool:
        """Whether a request with `tokens` (`cached` of them restorable now) should wait for one of
        `prefillers` (running, same prefix tree, same first chunk): one of them has not yet computed a
        chunk-aligned prefix it shares with the request and that goes beyond `cached`. A hit restores at a
        chunk boundary strictly before the last token, so only that far counts."""
        c = self.config.chunk_size
        reachable = (len(tokens) - 1) // c * c
        for r in prefillers:
            shared = 0
            end = min(reachable, (len(r.tokens) - 1) // c * c)
            while shared < end and tokens[shared:shared + c] == r.tokens[shared:shared + c]:
                shared += c
            if shared > cached and r.pos < shared:
                return True
        return False

    def _alloc(self, allocator: IndexAllocator, n: int, evict) -> list[int] | None:
        if allocator.num_free < n:
            evict(n - allocator.num_free)
        return allocator.alloc(n) if allocator.num_free >= n else None

    def _ensure_pages(self, r: _Running, end: int) -> bool:
        """Cover positions [0, end) with pages, evicting the cache, then retracting the newest running
        request (possibly r itself: then False). A request alone always fits: `submit` checks its size."""
        need = -(-end // self.config.page_size) - len(r.pages)
        while need > 0:
            new = self._alloc(self.kv.allocator, need, self._evict_pages)
            if new is not None:
                r.pages += new
                return True
            victim = self.running[-1]
            self._retract(victim)
            if victim is r:
                return False
        return True

    def _layout(self, batch: list[_Running], lengths: list[int]) -> BatchLayout:
        return BatchLayout.build(self.kv, [r.slot for r in batch], [r.pos for r in batch], lengths,
                                 [r.pages for r in batch], self.device)

    def _forward(self, batch: list[_Running], ids: list[int] | torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """One model step over `batch`: request n brings lengths[n] tokens (ids, request by request; a device
        tensor [N] for a decode step fed from the previous step's samples). Returns logits [N, V] at each
        request's last new token. Enqueues work without waiting for the device."""
        if not torch.is_tensor(ids):
            ids = to_device(ids, self.device)
        packed = any(t > 1 for t in lengths)
        if self.adapters is not None:
            self.adapters.set_batch([self.adapters.slot_of(r.req.adapter) for r in batch],
                                    lengths if packed else 1)
        if not packed and self.graphs is not None and self.graphs.usable(len(batch), max(r.pos for r in batch) + 1):
            return self.graphs.run(ids, [r.slot for r in batch], [r.pos for r in batch], [r.pages for r in batch])
        cache = PoolStateCache(self.kv, self.states, self._layout(batch, lengths))
        if packed:
            ids_t = ids[None, :]
            cu = to_device(torch.tensor([0, *lengths]).cumsum(0), self.device)
        else:
            ids_t, cu = ids[:, None], None
        with torch.inference_mode():
            return model_step(self.model, ids_t, cache, cu)

    def _chunk_end(self, r: _Running, budget: int) -> int:
        """Where r's next prefill chunk ends given `budget` tokens (r.pos itself when nothing fits)."""
        c = self.config.chunk_size
        end = min(len(r.tokens), (r.pos // c) * c + budget // c * c)
        if r.fork_pos is not None and r.pos < r.fork_pos < end:
            end = r.fork_pos  # snapshot exactly at the fork so the next branch restores there
        last_boundary = (len(r.tokens) - 1) // c * c
        if end == len(r.tokens) and r.pos < last_boundary < end:
            # stop at the last checkpoint boundary a later request with this prompt can restore from (a hit
            # never covers the final token): what GRPO's n samples of one prompt share
            end = last_boundary
        return max(end, r.pos)

    def _prefill(self) -> bool:
        """Pack prefill chunks of the oldest prefilling requests into one forward under the token budget.
        False when nothing was prefilled (no prefilling request, or all of them were retracted)."""
        plan: list[tuple[_Running, int]] = []
        budget = self.config.max_prefill_tokens
        for r in self.running:
            if len(r.tokens) - r.pos <= 1:
                continue
            if len(plan) == self.config.max_prefill_requests:
                break
            end = self._chunk_end(r, budget)
            if end == r.pos:
                break
            plan.append((r, end))
            budget -= end - r.pos
        for r, end in plan:
            if r in self.running:  # an earlier member's pages may have cost this one its place
                self._ensure_pages(r, end)
        plan = [(r, end) for r, end in plan if r in self.running]
        if not plan:
            return False
        batch = [r for r, _ in plan]
        lengths = [end - r.pos for r, end in plan]
        logits = self._forward(batch, [t for r, end in plan for t in r.tokens[r.pos:end]], lengths)
        done = []
        for i, (r, end) in enumerate(plan):
            r.pos = end
            self._donate(r)
            if r.pos == len(r.tokens):
                done.append(i)
        if done:
            rows = done if len(done) < len(plan) else slice(None)
            batch = [plan[i][0] for i in done]
            tokens, logps = sample(logits[rows], [r.req.params for r in batch], [r.generator for r in batch])
            self._append_samples(batch, tokens, logps)
        return True

    def _decode(self, candidates: list[_Running]) -> None:
        batch = []
        for r in candidates:
            # a member may have been retracted to make room for an earlier one
            if r in self.running and self._ensure_pages(r, r.pos + 1):
                batch.append(r)
        batch = [r for r in batch if r in self.running]
        if not batch:
            return
        launch = self._launch_decode(batch, [r.tokens[r.pos] for r in batch])
        if self._overlap:
            self._inflight = launch
        else:
            self._resolve(launch)

    def _launch_decode(self, batch: list[_Running], ids: list[int] | torch.Tensor) -> _DecodeLaunch:
        """Enqueue one decode token for each of `batch` (pages already cover it) and its sampling; snapshot
        the working state of rows reaching a chunk boundary now, before a later step overwrites it."""
        logits = self._forward(batch, ids, [1] * len(batch))
        tokens, logps = sample_on_device(logits, [r.req.params for r in batch], [r.generator for r in batch])
        both = torch.stack([tokens.to(torch.float64), logps.to(torch.float64)])
        ready = None
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = both
        snapshots = []
        for r in batch:
            r.pos += 1
            if r.pos % self.config.chunk_size == 0:
                snapshots.append((r, r.pos, self._snapshot(r)))
        return _DecodeLaunch(batch, tokens, host, ready, snapshots)

    def _resolve(self, launch: _DecodeLaunch) -> None:
        """Read a launched step's tokens back: tree inserts for its snapshots, then append and finish. Rows
        of requests that left meanwhile (stopped a step earlier, aborted) are discarded."""
        if launch.ready is not None:
            launch.ready.synchronize()
        tokens, logps = launch.host.tolist()
        running = set(self.running)
        for r, pos, snap in launch.snapshots:
            if r in running:
                self._donate_at(r, pos, snap)
            elif snap is not None:
                self.states.allocator.free([snap])
        live = [i for i, r in enumerate(launch.batch) if r in running]
        self._append_samples([launch.batch[i] for i in live], [int(tokens[i]) for i in live],
                             [logps[i] for i in live])

    def _continue_decode(self, prev: _DecodeLaunch) -> _DecodeLaunch | None:
        """Enqueue the next decode of `prev`'s requests, fed from its device tokens, before `prev` is read
        back; None when the next step needs the host to know them first: admissions or prefills pending,
        pages only a retraction could free. Rows that `prev` will finish by length are left out."""
        if self.waiting and len(self.running) < self.config.max_running:
            return None
        running = set(self.running)
        if not running <= set(prev.batch):
            return None  # a prefilling request
        keep = [i for i, r in enumerate(prev.batch)
                if r in running and len(r.req.output_ids) + 1 < r.req.params.max_new_tokens]
        if not keep:
            return None
        batch = [prev.batch[i] for i in keep]
        page = self.config.page_size
        short = [r for r in batch if -(-(r.pos + 1) // page) > len(r.pages)]
        new = self._alloc(self.kv.allocator, len(short), self._evict_pages) if short else []
        if new is None:
            return None
        for r, p in zip(short, new):
            r.pages.append(p)
        ids = prev.tokens if len(keep) == len(prev.batch) else \
            prev.tokens[to_device(keep, self.device)]
        return self._launch_decode(batch, ids)

    def _settle(self) -> None:
        """Read back an enqueued step none of whose requests is still running (they stopped or were
        aborted): nothing would read it otherwise, and its snapshot slots must return to the pool."""
        if self._inflight is not None and not any(r in self.running for r in self._inflight.batch):
            launch, self._inflight = self._inflight, None
            self._resolve(launch)

    def _append_samples(self, batch: list[_Running], tokens: list[int], logps: list[float]) -> None:
        for r, tok, lp in zip(batch, tokens, logps):
            req = r.req
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            r.tokens.append(tok)
            if req.request_id in self._events:
                self._events[req.request_id].append((tok, lp))
            if tok in req.params.stop_token_ids:
                self._finish(r, FinishReason.STOP)
            elif len(req.output_ids) >= req.params.max_new_tokens:
                self._finish(r, FinishReason.LENGTH)

    # ------------------------------------------------------- cache handovers
    def _donate(self, r: _Running) -> None:
        """Give the tree the page-aligned computed prefix and, at a chunk boundary, a snapshot of the
        working state (a copy into a fresh slot; the tree then owns that slot by index)."""
        self._donate_at(r, r.pos, self._snapshot(r) if r.pos % self.config.chunk_size == 0 else None)

    def _snapshot(self, r: _Running) -> int | None:
        """Copy r's working state into a fresh slot (None when no slot can be freed for it)."""
        snap = self._alloc(self.states.allocator, 1, self._evict_checkpoints)
        if snap is None:
            return None
        self.states.copy_slots([r.slot], snap)
        return snap[0]

    def _donate_at(self, r: _Running, pos: int, snap: int | None) -> None:
        """Insert r's computed prefix up to `pos` (<= r.pos; its tokens known) with the checkpoint `snap`
        taken at `pos`, and move r's lock to the node that ends there."""
        res = self._insert(r, {} if snap is None else {pos: snap}, end=pos)
        self.states.allocator.free(res.rejected_slots)
        r.cache.lock(res.node)
        r.cache.unlock(r.node)
        r.node = res.node

    def _release(self, r: _Running) -> None:
        self._donate_kv_only(r)
        r.cache.unlock(r.node)
        self.kv.allocator.free(r.private)
        self.states.allocator.free([r.slot])
        self.running.remove(r)

    def _donate_kv_only(self, r: _Running) -> None:
        self._insert(r, {})

    def _insert(self, r: _Running, checkpoints: dict[int, int], end: int | None = None):
        """Hand the page-aligned computed prefix to the tree. The request switches to the tree's pages and
        its duplicates (KV it recomputed for positions the tree had) are freed at once, so a request never
        holds two copies of a prefix: its footprint stays what `submit` checked against the pool. The
        freed pages are only rewritten by later kernels on the same stream."""
        full = (r.pos if end is None else end) // self.config.page_size
        res = r.cache.insert(r.tokens, r.pages[:full], checkpoints)
        r.pages[:full] = res.pages
        self.kv.allocator.free(res.duplicate_pages)
        r.tree_pages = full
        return res

    def _retract(self, r: _Running) -> None:
        self._release(r)
        r.req.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(r.req)

    def _finish(self, r: _Running, reason: FinishReason) -> None:
        self._release(r)
        self._completed.append(self._complete(r.req, reason))

    def _complete(self, req: Request, reason: FinishReason) -> Completion:
        req.finish_reason = reason
        self._generators.pop(req.request_id, None)
        return req.completion()

    def check_invariants(self) -> None:
        """Rebuild the accounting: every page / slot is in exactly one place (tree, a request, free)."""
        pages = {p for r in self.running for p in r.private}
        slots = {r.slot for r in self.running}
        if self._inflight is not None:  # snapshots taken, their tree inserts waiting for the tokens
            slots |= {snap for _, _, snap in self._inflight.snapshots if snap is not None}
        for name, cache in self.caches.items():
            others = [c for n, c in self.caches.items() if n != name]
            cache.sanity_check(pages.union(*(c.owned_pages() for c in others)),
                               slots.union(*(c.owned_slots() for c in others)))

    # ------------------------------------------------------------ colocation
    def counters(self) -> dict[str, int]:
        """Since the engine was built, across `release_memory`: decode CUDA graphs captured and replayed
        (0 without graphs) and requests retracted."""
        captures, replays = self._dropped_graph_counts
        if (g := self.graphs) is not None:
            captures, replays = captures + g.captures, replays + g.replays
        return {"graph_captures": captures, "graph_replays": replays, "retractions": self.num_retractions}

    def release_memory(self) -> None:
        """Drop the KV and state pools (and the prefix cache) so a colocated trainer can use the memory.
        Only between batches: no request may be waiting or running."""
        if self.has_work():
            raise RuntimeError("release_memory() with requests in flight; finish or abort them first")
        counts = self.counters()
        self._dropped_graph_counts = (counts["graph_captures"], counts["graph_replays"])
        self.kv = self.states = self.graphs = None  # type: ignore[assignment]
        self.caches = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.kv is None:
            self._build_pools()
