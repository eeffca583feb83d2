"""Well-behaved plugins: every signature the runner supports."""

import asyncio
import functools
import threading

import numpy as np
import torch

from miles_k3.rewards import Sample, batched


def length_reward(sample: Sample) -> float:
    return float(len(sample.response))


async def async_length_reward(sample: Sample) -> float:
    await asyncio.sleep(0)
    return float(len(sample.response))


@batched
def batched_length_reward(samples: list[Sample]) -> list[float]:
    return [float(len(s.response)) for s in samples]


@batched
async def async_batched_length_reward(samples: list[Sample]) -> list[float]:
    await asyncio.sleep(0)
    return [float(len(s.response)) for s in samples]


@batched
def batched_tensor_reward(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor([float(len(s.response)) for s in samples])


def numpy_scalar_reward(sample: Sample):
    return np.float32(len(sample.response))


def tensor_scalar_reward(sample: Sample):
    return torch.tensor(float(len(sample.response)))


def bool_reward(sample: Sample) -> bool:
    return sample.response == "yes"


class Scorers:
    @staticmethod
    def by_label(sample: Sample) -> float:
        return float(sample.label)


class AsyncCallable:
    """A callable instance whose __call__ is async, declared batched by class attribute."""

    __reward_batched__ = True

    async def __call__(self, samples):
        return [1.0 for _ in samples]


async_instance = AsyncCallable()


async def _scaled(scale: float, sample: Sample) -> float:
    return scale * len(sample.response)


async_partial = functools.partial(_scaled, 2.0)


# Concurrency probes: record the peak number of calls in flight.
_lock = threading.Lock()
active = 0
peak = 0


def reset_probe() -> None:
    global active, peak
    active = peak = 0


def _enter() -> None:
    global active, peak
    with _lock:
        active += 1
        peak = max(peak, active)


def _leave() -> None:
    global active
    with _lock:
        active -= 1


def slow_sync(sample: Sample) -> float:
    _enter()
    try:
        threading.Event().wait(0.05)
        return 1.0
    finally:
        _leave()


async def slow_async(sample: Sample) -> float:
    _enter()
    try:
        await asyncio.sleep(0.05)
        return 1.0
    finally:
        _leave()


seen_loops: list[asyncio.AbstractEventLoop] = []


async def remembers_loop(sample: Sample) -> float:
    seen_loops.append(asyncio.get_running_loop())
    return 1.0
