"""Misbehaving plugins. `selective` misbehaves per sample, as sample.metadata["do"] says."""

import asyncio
import math
import sys
import threading

from miles_k3.rewards import Sample, batched

# Hanging plugins wait on this; the tests' fixture sets it at teardown so no thread outlives a test
# by more than it must.
release = threading.Event()

NOT_CALLABLE = 3


def selective(sample: Sample):
    do = sample.metadata.get("do", "ok")
    if do == "ok":
        return float(sample.sample_index)
    if do == "raise":
        raise ValueError(f"boom on {sample.sample_index}")
    if do == "nan":
        return math.nan
    if do == "inf":
        return -math.inf
    if do == "huge":
        return 1e39  # finite in float64, not in float32
    if do == "str":
        return "1.0"
    if do == "none":
        return None
    if do == "list":
        return [1.0]
    if do == "hang":
        release.wait(30)
        return 1.0
    raise AssertionError(do)


async def async_selective(sample: Sample):
    if sample.metadata.get("do") == "hang":
        await asyncio.sleep(30)
    return selective(sample)


async def blocks_the_loop(sample: Sample) -> float:
    release.wait(30)  # a blocking call inside async def: the event loop itself stops
    return 1.0


def returns_coroutine(sample: Sample):
    return asyncio.sleep(0, result=1.0)


@batched
def wrong_length(samples):
    return [1.0] * (len(samples) - 1)


@batched
def returns_dict(samples):
    return {"rewards": [1.0] * len(samples)}


@batched
def batched_raises(samples):
    raise RuntimeError("batch service down")


@batched
def batched_hangs(samples):
    release.wait(30)
    return [1.0] * len(samples)


@batched
def batched_one_nan(samples):
    return [math.nan] + [1.0] * (len(samples) - 1)


def two_args(sample, other):
    return 1.0


def no_args():
    return 1.0


def needs_keyword(sample, *, scale):
    return 1.0


def generator(sample):
    yield 1.0


def exits(sample: Sample) -> float:
    sys.exit(3)
