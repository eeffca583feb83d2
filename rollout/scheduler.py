"""The scheduler: the request queues, and a plan for each engine step. Holds no tensors.

Each step is either one prefill forward or one decode forward. `schedule()` admits waiting requests into
free running places (oldest first, restoring their cached prefix), then plans prefill chunks of the oldest
prefilling requests packed under the `max_prefill_tokens` budget, each chunk ending on a `chunk_size`
boundary (where KDA checkpoints are snapshotted and donated); with nothing to prefill it plans one decode
token for every request in the decode phase. Pages for the planned positions are taken here, through the
cache manager: when the pools run dry even after evicting the trees, the newest running request is
retracted (what it computed is cached, its resources freed, and it goes back to the front of the queue with
its output so far; it finishes later, never lost or duplicated).

`continue_decode` plans the overlap schedule's next step (`rollout.decode`) before the host has read the
previous step's tokens, so it can only repeat that step's requests and never retracts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout.cache_manager import CacheManager, Running
from rollout.config import EngineConfig
from rollout.request import Request


@dataclass
class Plan:
    """One step's work: prefill chunks (request, end of its chunk) packed into one forward, or a decode batch
    (each request's next input token). Both empty: nothing to run."""

    prefill: list[tuple[Running, int]] = field(default_factory=list)
    decode: list[Running] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, memory: CacheManager, lookahead: int = 1):
        self.config, self.memory = config, memory
        self.lookahead = lookahead  # KV positions a decode step writes per row (`DecodeStrategy.lookahead`)
        self.waiting: deque[Request] = deque()
        self.running: list[Running] = []
        self.num_retractions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, request_id: int) -> Request | None:
        """Take the request out of the queue or the running set (its memory back); None if unknown."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        for r in self.running:
            if r.req.request_id == request_id:
                self.finish(r)
                return r.req
        return None

    def schedule(self) -> Plan:
        self._admit()
        if prefill := self._plan_prefill():
            return Plan(prefill=prefill)
        # A prefill whose requests could not get pages retracted them: decode instead, so the running
        # requests always progress (otherwise re-admitting them each step would starve them).
        return Plan(decode=self._plan_decode())

    # ------------------------------------------------------- admission
    def _admit(self) -> None:
        """Move waiting requests into free running places, oldest first, restoring their cached prefix. A
        request that shares more of its prompt with a request still prefilling than the cache holds waits
        (keeping its place in the queue) until that prefill has donated the shared part: GRPO's n samples
        of a prompt, submitted together, compute the prompt once instead of n times."""
        if not self.waiting or len(self.running) >= self.config.max_running:
            return
        c = self.config.chunk_size
        # (adapter, first chunk of the prompt) -> requests prefilling it
        prefilling: dict[tuple[str | None, tuple[int, ...]], list[Running]] = {}
        for r in self.running:
            if r.prefilling:
                prefilling.setdefault((r.req.adapter, tuple(r.keys[:c])), []).append(r)
        deferred: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting.popleft()
            tokens = req.all_ids
            keys = req.cache_keys(tokens)  # what the tree compares: media pads keyed by their image
            # a request still computing prompt log-probs must compute the logits row before its next position q:
            # matching only keys[:q] keeps the hit at or before q - 1 (a hit never covers the last key); it
            # does not wait to share a prefill either. (Unified memory's re-match in `CacheManager.admit` after
            # blocks moved uses the whole keys: positions a deeper hit skips get None, `Engine._prompt_logprobs`.)
            need = req.prompt_logprob_next
            m = self.memory.match(req.adapter, keys if need is None else keys[: max(need, 1)])
            if need is None and self._prefill_to_share(
                keys, m.prefix_len, prefilling.get((req.adapter, tuple(keys[:c])), ())
            ):
                deferred.append(req)
                continue
            r = self.memory.admit(req, tokens, m)
            if r is None:  # no state slot: wait for one to be released
                self.waiting.appendleft(req)
                break
            self.running.append(r)
            if r.prefilling:
                prefilling.setdefault((req.adapter, tuple(keys[:c])), []).append(r)
        self.waiting.extendleft(reversed(deferred))

    def _prefill_to_share(self, keys: list[int], cached: int, prefillers: Iterable[Running]) -> bool:
        """Whether a request with cache `keys` (`cached` of them restorable now) should wait for one of
        `prefillers` (running, same prefix tree, same first chunk): one of them has not yet computed a
        chunk-aligned prefix it shares with the request and that goes beyond `cached`. A hit restores at a
        chunk boundary strictly before the last token, so only that far counts. Keys, not ids: a prompt with
        other images shares nothing past its first pad."""
        c = self.config.chunk_size
        reachable = (len(keys) - 1) // c * c
        for r in prefillers:
            shared, theirs = 0, r.keys
            end = min(reachable, (len(theirs) - 1) // c * c)
            while shared < end and keys[shared : shared + c] == theirs[shared : shared + c]:
                shared += c
            if shared > cached and r.pos < shared:
                return True
        return False

    # --------------------------------------------------------- prefill
    def _plan_prefill(self) -> list[tuple[Running, int]]:
        """Chunks of the oldest prefilling requests under the token budget, their pages covered. Empty when
        there is nothing to prefill or every planned request was retracted for pages."""
        plan: list[tuple[Running, int]] = []
        budget = self.config.max_prefill_tokens
        for r in self.running:
            if not r.prefilling:
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
                self._cover(r, end)
        return [(r, end) for r, end in plan if r in self.running]

    def _chunk_end(self, r: Running, budget: int) -> int:
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

    # ---------------------------------------------------------- decode
    def _plan_decode(self) -> list[Running]:
        candidates = [r for r in self.running if len(r.tokens) - r.pos == 1]
        batch = []
        running, retractions = set(self.running), self.num_retractions  # a set: batches run to hundreds
        for r in candidates:
            # a member may have been retracted to make room for an earlier one
            if r in running and self._cover(r, self._decode_end(r)):
                batch.append(r)
            if self.num_retractions != retractions:
                running, retractions = set(self.running), self.num_retractions
        return [r for r in batch if r in running]

    def continue_decode(self, prev: list[Running]) -> list[int] | None:
        """The rows of `prev` (a decode batch whose tokens the host has not read yet) to decode once more,
        their pages covered; None when the next step needs the host to know those tokens first: admissions
        or prefills pending, or pages only a retraction could free. Rows `prev` finishes by length are left
        out (a length limit is known in advance; a stop token is not, so a stopping row is fed once more
        and its extra row discarded)."""
        if self.waiting and len(self.running) < self.config.max_running:
            return None
        running = set(self.running)
        if not running <= set(prev):
            return None  # a prefilling request
        keep = [
            i for i, r in enumerate(prev) if r in running and len(r.req.output_ids) + 1 < r.req.params.max_new_tokens
        ]
        if not keep:
            return None
        batch = [prev[i] for i in keep]
        if not self.memory.grow_all(batch, [self._decode_end(r) for r in batch]):
            return None
        return keep

    def _decode_end(self, r: Running) -> int:
        """The KV positions a decode step may write for r: `lookahead` past its computed ones, but never past
        the request's length limit (a multi-token strategy does not feed past it), so a request that `submit`
        sized to the whole pool still fits alone."""
        return min(r.pos + self.lookahead, len(r.req.prompt_ids) + r.req.params.max_new_tokens)

    # ------------------------------------------------------ lifecycle
    def _cover(self, r: Running, end: int) -> bool:
        """Pages for r's positions [0, end), evicting the trees, then retracting the newest running request
        (possibly r itself: then False). A request alone always fits: `submit` checks its size."""
        while not self.memory.grow(r, end):
            victim = self.running[-1]
            self.retract(victim)
            if victim is r:
                return False
        return True

    def retract(self, r: Running) -> None:
        """r goes back to the front of the queue with its output so far."""
        self._release(r)
        r.req.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(r.req)

    def finish(self, r: Running) -> None:
        """r is done (finished or aborted)."""
        self._release(r)

    def _release(self, r: Running) -> None:
        self.memory.release(r)
        self.running.remove(r)
