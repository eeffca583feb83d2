"""score(): signatures, concurrency, every failure kind under both policies, timeouts."""

import asyncio
import math
import time

import pytest
import torch

from miles_k3.rewards import (
    FAILURE_KINDS,
    RewardConfig,
    RewardPluginError,
    Sample,
    as_plugin,
    load_plugin,
    score,
    score_async,
)
from tests.rewards.plugins import good

P = "tests.rewards.plugins"
RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee"]


def samples(*actions: str) -> list[Sample]:
    return [
        Sample(prompt="p", response="r", label=None, metadata={"do": do}, group_index=i // 2, sample_index=i)
        for i, do in enumerate(actions)
    ]


def text_samples() -> list[Sample]:
    return [Sample(prompt="p", response=r, group_index=0, sample_index=i) for i, r in enumerate(RESPONSES)]


def cfg(fn: str, **kw) -> RewardConfig:
    return RewardConfig(fn=fn, **kw)


@pytest.mark.parametrize(
    "fn, batched, is_async",
    [
        ("good:length_reward", False, False),
        ("good:async_length_reward", False, True),
        ("good:batched_length_reward", True, False),
        ("good:async_batched_length_reward", True, True),
        ("good:batched_tensor_reward", True, False),
        ("good:numpy_scalar_reward", False, False),
        ("good:tensor_scalar_reward", False, False),
    ],
)
def test_every_signature_scores_the_same(fn, batched, is_async):
    config = cfg(f"{P}.{fn}")
    plugin = load_plugin(config)
    assert (plugin.batched, plugin.is_async) == (batched, is_async)
    result = score(text_samples(), config, plugin)
    assert result.rewards.dtype == torch.float32 and result.keep.dtype == torch.bool
    assert result.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert result.keep.all() and result.failures == () and result.num_dropped == 0
    assert result.failure_counts == dict.fromkeys(FAILURE_KINDS, 0)


def test_bool_counts_as_zero_or_one():
    s = [Sample("p", "yes"), Sample("p", "no")]
    assert score(s, cfg(f"{P}.good:bool_reward")).rewards.tolist() == [1.0, 0.0]


def test_callable_instance_and_partial_are_detected_async():
    inst = load_plugin(cfg(f"{P}.good:async_instance"))
    assert inst.batched and inst.is_async
    assert score(text_samples(), cfg(f"{P}.good:async_instance"), inst).rewards.tolist() == [1.0] * 5
    part = load_plugin(cfg(f"{P}.good:async_partial"))
    assert not part.batched and part.is_async
    assert score(text_samples()[:2], cfg(f"{P}.good:async_partial"), part).rewards.tolist() == [2.0, 4.0]


@pytest.mark.parametrize("fn", ["slow_sync", "slow_async"])
def test_per_sample_calls_are_concurrent_but_bounded(fn):
    good.reset_probe()
    config = cfg(f"{P}.good:{fn}", max_concurrency=3)
    result = score(samples(*["ok"] * 12), config)
    assert result.keep.all()
    assert good.peak == 3  # really concurrent, and never above the bound


def test_empty_batch_calls_nothing():
    result = score([], cfg(f"{P}.bad:batched_raises", on_failure="raise"))
    assert result.rewards.shape == (0,) and result.keep.shape == (0,) and result.failures == ()


def test_non_sample_input_is_a_type_error():
    with pytest.raises(TypeError, match="item 1 is a str"):
        score([Sample("p", "r"), "r"], cfg("exact_match"))


# --- failure kinds ------------------------------------------------------------------------------

PER_SAMPLE_CASES = [
    ("raise", "exception", "raised ValueError: boom on 1"),
    ("nan", "nonfinite", "returned nan"),
    ("inf", "nonfinite", "returned -inf"),
    ("huge", "nonfinite", "overflows float32"),
    ("str", "bad_type", "returned str '1.0'"),
    ("none", "bad_type", "returned NoneType None"),
    ("list", "bad_type", "returned list [1.0]"),
]


@pytest.mark.parametrize("fn", ["selective", "async_selective"])
@pytest.mark.parametrize("do, kind, message", PER_SAMPLE_CASES)
def test_per_sample_failure_is_dropped_and_counted(fn, do, kind, message):
    result = score(samples("ok", do, "ok", do), cfg(f"{P}.bad:{fn}", on_failure="drop"))
    assert result.keep.tolist() == [True, False, True, False]
    assert result.rewards[0] == 0.0 and result.rewards[2] == 2.0  # the good samples keep their rewards
    assert math.isnan(result.rewards[1]) and math.isnan(result.rewards[3])  # dropped, never zero
    assert result.failure_counts == {k: (2 if k == kind else 0) for k in FAILURE_KINDS}
    assert [(f.index, f.kind) for f in result.failures] == [(1, kind), (3, kind)]
    assert result.failures[0].message.startswith("group 0 sample 1: ")
    if do != "raise":
        assert message in result.failures[0].message


@pytest.mark.parametrize("do, kind, message", PER_SAMPLE_CASES)
def test_per_sample_failure_raises_with_plugin_indices_and_cause(do, kind, message):
    with pytest.raises(RewardPluginError) as info:
        score(samples("ok", do, "ok"), cfg(f"{P}.bad:selective", on_failure="raise"))
    err = info.value
    text = str(err)
    assert f"'{P}.bad:selective'" in text and "failed on 1 of 3 sample(s) (indices [1])" in text
    assert kind in text and message in text
    assert err.indices == [1] and err.failures[0].kind == kind
    if kind == "exception":
        assert isinstance(err.cause, ValueError) and err.__cause__ is err.cause
    else:
        assert err.cause is None


def test_mixed_failures_are_counted_by_kind():
    result = score(samples("ok", "raise", "nan", "str", "ok", "inf"), cfg(f"{P}.bad:selective", on_failure="drop"))
    assert result.keep.tolist() == [True, False, False, False, True, False]
    assert result.failure_counts == {"exception": 1, "nonfinite": 2, "timeout": 0, "bad_type": 1, "bad_length": 0}


def test_default_policy_is_raise():
    with pytest.raises(RewardPluginError):
        score(samples("raise"), cfg(f"{P}.bad:selective"))


BATCHED_CASES = [
    ("wrong_length", "bad_length", "batched call returned 3 rewards for 4 samples"),
    ("returns_dict", "bad_type", "batched call returned dict"),
    ("batched_raises", "exception", "raised RuntimeError: batch service down"),
]


@pytest.mark.parametrize("fn, kind, message", BATCHED_CASES)
def test_batched_failure_fails_the_whole_batch(fn, kind, message):
    result = score(samples("ok", "ok", "ok", "ok"), cfg(f"{P}.bad:{fn}", on_failure="drop"))
    assert not result.keep.any() and torch.isnan(result.rewards).all()
    assert result.failure_counts[kind] == 4
    assert all(message in f.message for f in result.failures)
    with pytest.raises(RewardPluginError, match=f"{kind} at indices \\[0, 1, 2, 3\\]: {message}") as info:
        score(samples("ok", "ok", "ok", "ok"), cfg(f"{P}.bad:{fn}", on_failure="raise"))
    assert str(info.value).count(message) == 1  # one reason, listed once


def test_batched_element_failure_drops_only_that_sample():
    result = score(samples("ok", "ok", "ok"), cfg(f"{P}.bad:batched_one_nan", on_failure="drop"))
    assert result.keep.tolist() == [False, True, True]
    assert result.failure_counts["nonfinite"] == 1


def test_sync_function_returning_a_coroutine_is_a_bad_type():
    result = score(samples("ok"), cfg(f"{P}.bad:returns_coroutine", on_failure="drop"))
    assert result.failures[0].kind == "bad_type" and "async def" in result.failures[0].message


# --- timeouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["selective", "async_selective"])
def test_hanging_sample_times_out_without_hanging_the_run(fn):
    config = cfg(f"{P}.bad:{fn}", timeout_s=0.3, on_failure="drop", max_concurrency=4)
    start = time.monotonic()
    result = score(samples("ok", "hang", "ok", "hang"), config)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, elapsed
    assert result.keep.tolist() == [True, False, True, False]
    assert result.failure_counts["timeout"] == 2
    assert "no result within 0.3 s" in result.failures[0].message
    assert ("thread may still be running" in result.failures[0].message) == (fn == "selective")


def test_hanging_sample_raises_timeout_under_raise_policy():
    config = cfg(f"{P}.bad:selective", timeout_s=0.2, on_failure="raise")
    start = time.monotonic()
    with pytest.raises(RewardPluginError, match=r"timeout at indices \[0\]: no result within 0.2 s") as info:
        score(samples("hang", "ok"), config)
    assert time.monotonic() - start < 2.0
    assert isinstance(info.value.cause, TimeoutError)


def test_hanging_batched_call_times_out():
    start = time.monotonic()
    result = score(samples("ok", "ok"), cfg(f"{P}.bad:batched_hangs", timeout_s=0.2, on_failure="drop"))
    assert time.monotonic() - start < 2.0
    assert result.failure_counts["timeout"] == 2


def test_async_plugin_blocking_the_loop_is_timed_out_and_the_next_call_works():
    config = cfg(f"{P}.bad:blocks_the_loop", timeout_s=0.2, on_failure="drop")
    start = time.monotonic()
    result = score(samples("ok", "ok"), config)
    assert time.monotonic() - start < 3.0  # the guard: 1.1 * rounds * timeout + 1 s
    assert result.failure_counts["timeout"] == 2 and "event loop was blocked" in result.failures[0].message
    # The blocked loop was abandoned: the next call runs on a fresh one and succeeds.
    assert score(samples("ok"), cfg(f"{P}.bad:selective")).keep.all()


# --- loops --------------------------------------------------------------------------------------


def test_async_plugins_see_one_loop_across_calls():
    config = cfg(f"{P}.good:remembers_loop")
    good.seen_loops.clear()
    score(samples("ok"), config)
    score(samples("ok"), config)
    assert len(good.seen_loops) == 2 and good.seen_loops[0] is good.seen_loops[1]


def test_score_async_runs_on_the_callers_loop():
    config = cfg(f"{P}.good:remembers_loop")

    async def main():
        good.seen_loops.clear()
        result = await score_async(samples("ok", "ok"), config)
        return result, asyncio.get_running_loop()

    result, loop = asyncio.run(main())
    assert result.keep.all() and good.seen_loops == [loop, loop]


def test_score_works_from_inside_a_running_loop():
    async def main():
        return score(text_samples(), cfg(f"{P}.good:async_length_reward"))

    assert asyncio.run(main()).rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_as_plugin_wraps_a_lambda():
    config = cfg("unused:name")
    plugin = as_plugin(lambda s: 0.5, config, name="half")
    assert score(samples("ok"), config, plugin).rewards.tolist() == [0.5]


def test_plugin_error_pickles_with_its_fields():
    import pickle

    with pytest.raises(RewardPluginError) as info:
        score(samples("ok", "str"), cfg(f"{P}.bad:selective", on_failure="raise"))
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.indices == [1] and copy.plugin == f"{P}.bad:selective"


def test_sys_exit_in_a_sync_plugin_is_an_ordinary_failure():
    result = score(samples("ok", "ok"), cfg(f"{P}.bad:exits", on_failure="drop"))
    assert result.failure_counts["exception"] == 2
    assert "raised RuntimeError: SystemExit: 3" in result.failures[0].message
    assert score(samples("ok"), cfg(f"{P}.bad:selective")).keep.all()  # the loop survived
