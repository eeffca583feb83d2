"""Bridges between blocking code and asyncio that never block on a hung callee.

`run_in_thread` runs a blocking call in its own daemon thread and returns an asyncio future.
We avoid ThreadPoolExecutor (and so `loop.run_in_executor` / `asyncio.to_thread`) on purpose:
its worker threads are joined at interpreter exit, so one reward function stuck forever would
keep the process from ever exiting. A daemon thread that outlives its timeout just lingers,
holding whatever it holds, until it returns or the process ends.

`BackgroundLoop` is the one event loop on which `score()` runs plugins. It lives in a daemon
thread for the life of the process, so async plugins may keep loop-bound state (HTTP sessions,
semaphores) across calls, and `score()` works whether or not the caller has a loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_thread(fn: Callable[..., T], *args: Any, name: str = "reward") -> asyncio.Future[T]:
    """Call fn(*args) in a new daemon thread; the returned future (on the running loop) gets its
    result or exception. Cancelling the future does not stop the thread: it cannot be stopped."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if future.done():  # the caller timed out or was cancelled: nobody wants the value
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            value, ok = fn(*args), True
        except Exception as exc:  # noqa: BLE001 -- handed to the awaiting side, not swallowed
            value, ok = exc, False
        except BaseException as exc:  # noqa: BLE001
            # SystemExit / KeyboardInterrupt raised out of a task would stop the event loop itself;
            # in a worker thread they are just this call's failure.
            value, ok = RuntimeError(f"{type(exc).__name__}: {exc}"), False
            value.__cause__ = exc
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:
            pass  # the loop is closed: its owner stopped waiting long ago

    threading.Thread(target=target, name=f"miles-k3-{name}", daemon=True).start()
    return future


class BackgroundLoop:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="miles-k3-reward-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # stopped (abandoned): finish off what is left, then release the selector
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Ask the loop to stop; if a plugin is blocking it, it stops once the plugin returns."""
        self.loop.call_soon_threadsafe(self.loop.stop)


_lock = threading.Lock()
_current: BackgroundLoop | None = None


def background_loop() -> BackgroundLoop:
    """The shared loop, started on first use and restarted in a forked child (threads do not
    survive fork) or after `abandon`."""
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid():
            _current = BackgroundLoop()
        return _current


def abandon(loop: BackgroundLoop) -> None:
    """Stop using `loop` (a plugin blocked it); the next `background_loop()` starts a fresh one."""
    global _current
    with _lock:
        if _current is loop:
            _current = None
    loop.stop()
