"""Calling a reward plugin on a batch: concurrency, deadlines and the failure policy.

Per-sample sync functions run each in a daemon thread, at most max_concurrency at once; async
ones run as tasks on an event loop under asyncio.wait_for, at most max_concurrency at once.
Batched functions are called once with the whole list (sync ones in a daemon thread).

A failure is one of FAILURE_KINDS:
    exception   the call raised (a batched call that raises fails every sample)
    nonfinite   the reward is NaN or +-inf, or does not fit in float32
    timeout     no result within the plugin's deadline
    bad_type    the reward is not a real number (bool counts as 0/1; 1-element tensors and numpy
                scalars are read), or a batched call did not return a list / tuple / 1-D array
    bad_length  a batched call returned a different number of rewards than samples
With on_failure="drop" the failed samples get reward NaN and keep=False, and are counted; with
"raise", RewardPluginError names the plugin, the samples and the original exception. A failure
never becomes a reward of zero.

A sync function that hangs is reported as timed out and the call returns, but its thread cannot
be killed: it lingers (holding what it holds) until the function returns or the process exits,
and it no longer counts against max_concurrency. `score` additionally guards against async
plugins that block the event loop itself (time.sleep inside async def): past a deadline derived
from the plugin's timeout, every sample is reported as timed out and a fresh loop is used next.
(An async plugin's own `asyncio.to_thread` work that hangs is beyond reach: asyncio's executor
threads are joined when the interpreter exits.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from miles_k3.data.sample import Sample
from miles_k3.rewards._aio import abandon, background_loop, run_in_thread
from miles_k3.rewards.config import RewardConfig
from miles_k3.rewards.plugin import RewardPlugin, load_plugin

logger = logging.getLogger(__name__)

EXCEPTION, NONFINITE, TIMEOUT, BAD_TYPE, BAD_LENGTH = "exception", "nonfinite", "timeout", "bad_type", "bad_length"
FAILURE_KINDS = (EXCEPTION, NONFINITE, TIMEOUT, BAD_TYPE, BAD_LENGTH)
_FLOAT32_MAX = torch.finfo(torch.float32).max
_REPR_LIMIT = 120


class Failure(NamedTuple):
    """One sample that got no reward. index: its position in the scored list."""

    index: int
    kind: str
    message: str


class RewardResult(NamedTuple):
    """rewards: float32 [n], NaN where keep is False. keep: bool [n].
    failure_counts: every kind of FAILURE_KINDS (zeros included), for metrics.
    failures: one entry per failed sample, in index order."""

    rewards: torch.Tensor
    keep: torch.Tensor
    failure_counts: dict[str, int]
    failures: tuple[Failure, ...]

    @property
    def num_dropped(self) -> int:
        return len(self.failures)


class RewardPluginError(RuntimeError):
    """A reward plugin failed under on_failure="raise".

    plugin: the reference (RewardConfig.fn); failures: the failed samples; indices: their
    positions; cause (also __cause__): the first original exception, None when every failure
    was a bad return value. Constructible from the message alone, so it pickles (Ray actors).
    """

    def __init__(
        self, message: str, plugin: str = "", failures: Sequence[Failure] = (), cause: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.failures = tuple(failures)
        self.cause = cause

    @property
    def indices(self) -> list[int]:
        return [f.index for f in self.failures]


def _error_message(plugin: str, num_samples: int, failures: list[Failure], reasons: list[tuple[str, str]]) -> str:
    # Group identical reasons so that a batched failure reads once, not once per sample.
    by_reason: dict[tuple[str, str], list[int]] = {}
    for failure, reason in zip(failures, reasons):
        by_reason.setdefault(reason, []).append(failure.index)
    parts = [f"{kind} at indices {_short_list(idx)}: {msg}" for (kind, msg), idx in by_reason.items()]
    shown = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more distinct failures" if len(parts) > 3 else "")
    indices = _short_list([f.index for f in failures])
    return f"reward plugin {plugin!r} failed on {len(failures)} of {num_samples} sample(s) (indices {indices}): {shown}"


class _Failed(NamedTuple):
    kind: str
    message: str
    exc: BaseException | None = None


def score(samples: Iterable[Sample], config: RewardConfig, plugin: RewardPlugin | None = None) -> RewardResult:
    """Score samples with config.fn (or with `plugin`, loaded once by the caller via load_plugin).

    Blocking; runs the plugin on the package's background event loop, so it may be called from
    any thread, and async plugins may keep loop-bound state between calls. Inside a coroutine
    prefer `await score_async(...)`, which does not block the caller's loop.
    """
    samples = _as_samples(samples)
    plugin = plugin or load_plugin(config)
    bg = background_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is bg.loop:
        raise RuntimeError("score() was called from inside a reward plugin; call the function directly instead")
    future = bg.submit(_run(plugin, samples, config.max_concurrency))
    guard_s = _guard_s(plugin, len(samples), config.max_concurrency)
    done, _ = concurrent.futures.wait([future], timeout=guard_s)
    if done:
        outcomes = future.result()
    else:
        future.cancel()
        abandon(bg)
        message = (
            f"the event loop was blocked for {guard_s:.1f} s: an async plugin made a blocking call "
            "(use await asyncio.sleep / an async client, or make the function sync)"
        )
        outcomes = [_Failed(TIMEOUT, message)] * len(samples)
    return _finish(plugin, samples, outcomes, config.on_failure)


async def score_async(
    samples: Iterable[Sample], config: RewardConfig, plugin: RewardPlugin | None = None
) -> RewardResult:
    """`score` on the caller's running loop (no blocked-loop guard: the caller owns the loop)."""
    samples = _as_samples(samples)
    plugin = plugin or load_plugin(config)
    outcomes = await _run(plugin, samples, config.max_concurrency)
    return _finish(plugin, samples, outcomes, config.on_failure)


def _as_samples(samples: Iterable[Sample]) -> list[Sample]:
    samples = list(samples)
    for i, sample in enumerate(samples):
        if not isinstance(sample, Sample):
            raise TypeError(f"score() takes Sample objects; item {i} is a {type(sample).__name__}")
    return samples


def _guard_s(plugin: RewardPlugin, n: int, max_concurrency: int) -> float:
    # Each call ends within its timeout, so per-sample work needs at most ceil(n / c) rounds.
    rounds = 1 if plugin.batched else max(1, math.ceil(n / max_concurrency))
    budget = rounds * plugin.timeout_s
    return budget * 1.1 + 1.0


async def _run(plugin: RewardPlugin, samples: list[Sample], max_concurrency: int) -> list[float | _Failed]:
    if not samples:
        return []
    if plugin.batched:
        return await _run_batched(plugin, samples)
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(sample: Sample) -> float | _Failed:
        async with semaphore:
            try:
                value = await _invoke(plugin, sample)
            except Exception as exc:  # noqa: BLE001 -- every plugin error goes through the policy
                return _from_exception(plugin, exc)
        return _check_value(value)

    return list(await asyncio.gather(*(one(s) for s in samples)))


async def _run_batched(plugin: RewardPlugin, samples: list[Sample]) -> list[float | _Failed]:
    n = len(samples)
    try:
        values = await _invoke(plugin, list(samples))  # a copy: the plugin may not reorder ours
    except Exception as exc:  # noqa: BLE001
        return [_from_exception(plugin, exc)] * n
    if getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):  # 1-D torch tensor / numpy array
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        return [_Failed(BAD_TYPE, f"batched call returned {_describe(values)}; expected a list of {n} floats")] * n
    if len(values) != n:
        return [_Failed(BAD_LENGTH, f"batched call returned {len(values)} rewards for {n} samples")] * n
    return [_check_value(v) for v in values]


async def _invoke(plugin: RewardPlugin, arg: Any) -> Any:
    if plugin.is_async:
        return await asyncio.wait_for(plugin.fn(arg), plugin.timeout_s)
    return await asyncio.wait_for(run_in_thread(plugin.fn, arg, name=f"reward-{plugin.name}"), plugin.timeout_s)


def _from_exception(plugin: RewardPlugin, exc: Exception) -> _Failed:
    if isinstance(exc, TimeoutError):
        if str(exc):  # raised by the plugin itself (e.g. the remote reward gave up)
            return _Failed(TIMEOUT, f"{type(exc).__name__}: {exc}", exc)
        lingering = "" if plugin.is_async else " (its thread may still be running)"
        return _Failed(TIMEOUT, f"no result within {plugin.timeout_s:g} s{lingering}", exc)
    return _Failed(EXCEPTION, f"raised {type(exc).__name__}: {exc}", exc)


def _check_value(value: Any) -> float | _Failed:
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # never awaited on purpose; avoids a RuntimeWarning
        return _Failed(BAD_TYPE, "returned an awaitable; declare the function `async def` so that it is awaited")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return _Failed(BAD_TYPE, f"returned a tensor of shape {tuple(value.shape)}; expected one real number")
        value = value.item()
    if not isinstance(value, numbers.Real):
        return _Failed(BAD_TYPE, f"returned {_describe(value)}; expected a real number")
    try:
        reward = float(value)
    except (OverflowError, ValueError):
        return _Failed(NONFINITE, f"returned {_describe(value)}, which does not fit in a float")
    if not math.isfinite(reward):
        return _Failed(NONFINITE, f"returned {reward}")
    if abs(reward) > _FLOAT32_MAX:
        return _Failed(NONFINITE, f"returned {reward}, which overflows float32")
    return reward


def _finish(
    plugin: RewardPlugin, samples: list[Sample], outcomes: list[float | _Failed], on_failure: str
) -> RewardResult:
    assert len(outcomes) == len(samples), (len(outcomes), len(samples))
    rewards = [math.nan] * len(samples)
    keep = [False] * len(samples)
    failures: list[Failure] = []
    reasons: list[tuple[str, str]] = []
    cause: BaseException | None = None
    for i, (sample, outcome) in enumerate(zip(samples, outcomes)):
        if isinstance(outcome, _Failed):
            failures.append(Failure(i, outcome.kind, f"{sample.where}: {outcome.message}"))
            reasons.append((outcome.kind, outcome.message))
            if cause is None:
                cause = outcome.exc
        else:
            rewards[i], keep[i] = outcome, True
    if failures and on_failure == "raise":
        message = _error_message(plugin.name, len(samples), failures, reasons)
        raise RewardPluginError(message, plugin.name, failures, cause) from cause
    counts = dict.fromkeys(FAILURE_KINDS, 0)
    for failure in failures:
        counts[failure.kind] += 1
    if failures:
        summary = ", ".join(f"{kind}={count}" for kind, count in counts.items() if count)
        logger.warning(
            "reward plugin %r dropped %d of %d samples (%s); first: %s",
            plugin.name,
            len(failures),
            len(samples),
            summary,
            failures[0].message,
        )
    return RewardResult(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        keep=torch.tensor(keep, dtype=torch.bool),
        failure_counts=counts,
        failures=tuple(failures),
    )


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > _REPR_LIMIT:
        text = text[:_REPR_LIMIT] + "..."
    return f"{type(value).__name__} {text}"


def _short_list(indices: list[int], limit: int = 10) -> str:
    if len(indices) <= limit:
        return str(indices)
    return "[" + ", ".join(map(str, indices[:limit])) + f", ... ({len(indices)} in all)]"
