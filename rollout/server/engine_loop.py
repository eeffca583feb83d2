"""The one thread that drives the engine: every `submit`, `abort` and `step` of the server happens here.

The engine is not thread-safe, and its continuous batching wants every request in one place: so the
asyncio side never touches it. It hands commands to this thread through a queue (`submit`, `abort`,
`call`), and the thread, between steps, applies them all, runs one `engine.step()` while there is work,
and hands each request's new tokens back to the event loop that submitted it, one
`call_soon_threadsafe` per step for all of them, into the request's `asyncio.Queue`. Requests from any
number of connections so share every forward.

Every request is submitted with `stream=True`, and the tokens of one still running come from
`Engine.take_tokens` after each step. The completion stays authoritative: a request's last update carries
every token not yet handed over.

What is safe to call from where:
- `submit`, `abort`: from a coroutine (they capture the running event loop); never block.
- `call(fn)`: awaitable from a coroutine; `fn(engine)` runs on the loop thread between two steps (tests,
  stats and the control routes reach the engine this way).
- `pause()`, `resume()`: from anywhere. While paused no step runs: requests in flight keep their pages,
  slots and place, new ones queue in the engine, commands (submit, abort, `call`) are still applied.
- `retract()`: awaitable from a coroutine; pauses, and moves every request in flight out of the engine
  (SGLang's retract pause): `resume()` puts them back, ahead of any sent meanwhile.
- `start`, `stop`: from the thread that owns the server (its startup and shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from rollout.engine import Engine
from rollout.request import Completion, FinishReason, PromptLogprobs, Request, SamplingParams

log = logging.getLogger("rollout.server")


@dataclass
class Update:
    """What the engine produced for one sample since its last update."""

    index: int  # the sample's position in its request (the ticket's index)
    token_ids: list[int]
    logprobs: list[float]
    finish: FinishReason | None = None  # set on the sample's last update
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (with the last update)
    error: str | None = None  # the engine refused the request (its ValueError), or failed
    status: int = 400  # the HTTP status `error` maps to (500: the engine itself failed)
    # per token, when the params ask: the top (token id, log-prob) pairs and the given ids' log-probs
    top: list[list[tuple[int, float]] | None] | None = None
    ids: list[list[float] | None] | None = None
    prompt: PromptLogprobs | None = None  # the prompt log-probs, once computed (with the first tokens)
    shutdown: bool = False  # with finish ABORT: aborted because the server is going away
    # with the finish, under EngineConfig.record_routing: Completion.routed_experts (every token's experts)
    routed_experts: object | None = None


@dataclass(eq=False)
class Ticket:
    """One sample as the caller holds it. Its updates arrive, tagged with `index`, in `queue` (which
    several tickets of one request may share)."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop = field(repr=False)  # the event loop `queue` belongs to
    index: int = 0
    images: tuple = ()  # the prompt's images (`Engine.submit`'s images), in pad order
    # on the loop thread only
    request_id: int | None = None
    sent: int = 0  # output tokens already handed over
    cancelled: bool = False  # aborted before (or while) it was submitted
    shutdown: bool = False  # aborted because the server is going away (not by a caller)


class _Outbox:
    """The updates of one loop iteration, delivered per event loop in one call."""

    def __init__(self):
        self.by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, Update]]] = defaultdict(list)

    def put(self, ticket: Ticket, update: Update) -> None:
        self.by_loop[ticket.loop].append((ticket, update))

    def send(self) -> None:
        for loop, items in self.by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is waiting for these any more
                pass
        self.by_loop.clear()


def _deliver(items: list[tuple[Ticket, Update]]) -> None:
    for ticket, update in items:
        ticket.queue.put_nowait(update)


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: list[Callable[[_Outbox], None]] = []
        self._wake = threading.Condition()
        self._tickets: dict[int, Ticket] = {}  # engine request id -> ticket (loop thread only)
        self._closing = False
        self.failure: str | None = None  # set when engine.step() raised: the engine is no longer used
        self.paused = False  # no step runs while set (`pause`)
        # requests a retract pause took out of the engine, oldest first, until `resume` (loop thread only)
        self._parked: deque[Request] = deque()
        # since start (written on the loop thread): requests finished (and by finish reason), their prompt
        # tokens, the prompt tokens served from the prefix cache, tokens generated
        self.totals: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort whatever is still in flight (each gets a final ABORT update) and end the thread."""
        with self._wake:
            self._closing = True
            self._commands.append(self._abort_all)
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def _post(self, command: Callable[[_Outbox], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    # ------------------------------------------------------ from a coroutine
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        queue: asyncio.Queue,
        index: int = 0,
        images: tuple = (),
    ) -> Ticket:
        ticket = Ticket(prompt_ids, params, adapter, queue, asyncio.get_running_loop(), index, tuple(images))
        self._post(lambda out: self._submit(ticket, out))
        return ticket

    def abort(self, ticket: Ticket, shutdown: bool = False) -> None:
        """Stop generating for `ticket` and free its pages and slots. Idempotent; a no-op once it finished.
        `shutdown`: the server is going away (its last update says so), not a caller's abort."""
        self._post(lambda out: self._abort(ticket, out, shutdown))

    def pause(self) -> None:
        """Run no step until `resume()`: requests in flight stay where they are (SGLang's in_place pause)."""
        with self._wake:
            self.paused = True

    def resume(self) -> None:
        """Steps run again; requests a retract pause parked go back to the engine first, in their order."""
        with self._wake:
            self.paused = False
            self._commands.append(self._unpark)
            self._wake.notify()

    async def retract(self) -> None:
        """Pause (as `pause`), then retract every request in flight, returning once done (SGLang's retract
        pause). Each running request is retracted as the scheduler retracts one under memory pressure
        (`rollout.scheduler.Scheduler.retract`: its computed prefix left in the radix cache, its pages and
        state slot back in the pools, its output so far kept), then every queued one is parked here, outside
        the engine: the engine is idle (both pools back to full once the cache is flushed), so the cache can
        be flushed and the memory released meanwhile. After `resume` they go on from their tokens; a seeded
        or greedy request's output is the one it would have had without the pause (its noise is keyed by
        its seed and position, `rollout.noise`). RuntimeError for a sharded engine, whose other ranks would
        not see the retraction."""
        if self.engine.tp.size > 1:  # refused before pausing: a refusal leaves the server as it was
            raise RuntimeError("pause_generation mode retract on a sharded engine: its other ranks would not retract")
        self.pause()
        await self.call(lambda engine: self._retract_all())

    @property
    def parked(self) -> int:
        """Requests a retract pause holds (read on the loop thread: inside `call`)."""
        return len(self._parked)

    def parked_adapters(self) -> set[str | None]:
        """The adapters of the requests a retract pause holds (on the loop thread: inside `call`); the engine,
        which refuses to unload an adapter its requests use, does not see these."""
        return {req.adapter for req in self._parked}

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """`fn(engine)` on the loop thread between steps; its result (or exception) comes back here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run(out: _Outbox) -> None:
            try:
                result, error = fn(self.engine), None
            except BaseException as e:  # handed to the awaiting coroutine, not raised on this thread
                result, error = None, e
            loop.call_soon_threadsafe(_settle, future, result, error)

        self._post(run)
        return await future

    # ---------------------------------------------------------- loop thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._commands and not self._has_work():
                    if self._closing:
                        return
                    self._wake.wait()
                commands, self._commands = self._commands, []
            out = _Outbox()
            for command in commands:
                command(out)
            if self._has_work():
                self._step(out)
            out.send()

    def _has_work(self) -> bool:
        """Whether a step should run: not paused, the memory not released (requests wait meanwhile)."""
        return self.failure is None and not self.paused and self.engine.kv is not None and self.engine.has_work()

    def _step(self, out: _Outbox) -> None:
        try:
            done = self.engine.step()
        except Exception as e:  # a bug in the engine: fail every request in flight, keep answering HTTP
            log.exception("engine.step() failed; the server answers 503 from now on")
            self.failure = f"{type(e).__name__}: {e}"
            for ticket in self._tickets.values():
                out.put(ticket, Update(ticket.index, [], [], error=f"engine failed: {self.failure}", status=500))
            self._tickets.clear()
            return
        finished = {c.request_id: c for c in done}
        for rid, ticket in list(self._tickets.items()):
            if rid in finished:
                self._finish(ticket, finished[rid], out)
                continue
            events = self.engine.take_events(rid)
            if events:
                ticket.sent += len(events)
                p = ticket.params
                out.put(
                    ticket,
                    Update(
                        ticket.index,
                        [e.token for e in events],
                        [e.logprob for e in events],
                        top=[e.top for e in events] if p.top_logprobs else None,
                        ids=[e.ids for e in events] if p.token_ids_logprob else None,
                        prompt=events[0].prompt,
                    ),
                )

    def _finish(self, ticket: Ticket, c: Completion, out: _Outbox) -> None:
        """The sample's last update: every token not yet handed over (the completion is authoritative)."""
        self._tickets.pop(c.request_id, None)
        self.engine.take_tokens(c.request_id)  # drops the engine's record (the completion is authoritative)
        t = self.totals
        t["requests"] += 1
        t[f"finish_{c.finish_reason.value}"] += 1
        t["prompt_tokens"] += len(c.prompt_ids)
        t["cached_tokens"] += min(c.cached_tokens, len(c.prompt_ids))  # a re-admission may hit its own outputs
        t["generation_tokens"] += len(c.output_ids)
        new = slice(ticket.sent, None)
        ticket.sent = len(c.output_ids)
        update = Update(ticket.index, c.output_ids[new], (c.logprobs or [])[new], c.finish_reason, c.cached_tokens)
        update.top = None if c.top_logprobs is None else c.top_logprobs[new]
        update.ids = None if c.token_ids_logprobs is None else c.token_ids_logprobs[new]
        update.prompt, update.shutdown, update.routed_experts = c.prompt, ticket.shutdown, c.routed_experts
        out.put(ticket, update)

    def _submit(self, ticket: Ticket, out: _Outbox) -> None:
        if ticket.cancelled:
            return
        if self.failure is not None or self._closing:
            why = f"engine failed: {self.failure}" if self.failure else "the server is shutting down"
            out.put(ticket, Update(ticket.index, [], [], error=why, status=503))
            return
        try:
            rid = self.engine.submit(
                ticket.prompt_ids, ticket.params, ticket.adapter, stream=True, images=list(ticket.images) or None
            )
        except ValueError as e:  # the engine's own checks (token ids, length, pool size, adapter, images)
            out.put(ticket, Update(ticket.index, [], [], error=str(e)))
            return
        ticket.request_id = rid
        self._tickets[rid] = ticket

    def _abort(self, ticket: Ticket, out: _Outbox, shutdown: bool = False) -> None:
        ticket.cancelled = True
        ticket.shutdown = ticket.shutdown or shutdown
        rid = ticket.request_id
        if rid is None or rid not in self._tickets:
            return  # not submitted yet (then never will be), or already finished
        parked = next((req for req in self._parked if req.request_id == rid), None)
        if parked is not None:  # back in the engine's queue, where its abort finds it
            self._parked.remove(parked)
            self.engine.scheduler.waiting.appendleft(parked)
        completion = self.engine.abort(rid)
        if completion is not None:
            self._finish(ticket, completion, out)
        else:
            self._tickets.pop(rid, None)
            self.engine.take_tokens(rid)

    def _abort_all(self, out: _Outbox) -> None:
        for ticket in list(self._tickets.values()):
            self._abort(ticket, out, shutdown=True)

    def _retract_all(self) -> None:
        engine = self.engine
        s = engine.scheduler
        for r in reversed(list(s.running)):  # newest first: each goes to the queue's front, so order is kept
            s.retract(r)
        engine.decoder.settle()  # an enqueued step of the retracted rows is read back (its tokens recomputed)
        self._parked.extend(s.waiting)
        s.waiting.clear()

    def _unpark(self, out: _Outbox) -> None:
        self.engine.scheduler.waiting.extendleft(reversed(self._parked))
        self._parked.clear()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
