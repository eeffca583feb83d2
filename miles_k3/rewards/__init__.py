"""Reward plugins: the functions that score generated responses.

Choosing one (RewardConfig.fn, e.g. `reward.fn=...` in the recipe):
    "exact_match", "math_final_answer", "arithmetic"   built-ins (see `builtin`, `math_answer`)
    "remote"                                           an HTTP service (see `remote`; needs `url`)
    "my_project.rewards:score"                         any importable function, by path
    "my_reward"                                        a name in the `miles_k3.rewards` entry-point
                                                       group of an installed package:
        # the plugin package's pyproject.toml
        [project.entry-points."miles_k3.rewards"]
        my_reward = "my_project.rewards:score"
Built-in names are reserved (an entry point cannot shadow them).

A `Sample` is the run's one record of a sample (`miles_k3.data.sample`); a reward function reads its
`prompt` and `response` text, `label`, `metadata`, `group_index` and `sample_index` (under K3's chat encoding,
data.chat_template=k3: `response` is the reply's response channel, `reasoning` its think channel, `tool_calls`
its tool calls), and must not change it (the trainer reads the same object afterwards).

The two signatures. A reward function takes one positional argument:

    # per-sample: one Sample in, one float out
    def score(sample: Sample) -> float:
        return 1.0 if sample.response.strip() == sample.label else 0.0

    # batched: the whole batch in, one float per sample out, same order and length
    @batched
    def score_all(samples: list[Sample]) -> list[float]:
        return [float(len(s.response) < 100) for s in samples]

Either may be `async def` (awaited on an event loop, e.g. to call a service):

    async def judge(sample: Sample) -> float:
        reply = await my_client.ask(sample.prompt, sample.response)
        return reply.score

`@batched` only sets `fn.__reward_batched__ = True`; a callable class may set that class
attribute itself. Per-sample functions run concurrently (RewardConfig.max_concurrency): sync
ones in threads, so they must be thread-safe. Return a real number (int, float, bool as 0/1,
numpy scalar, 1-element tensor); a batched function returns a list, tuple or 1-D array.

Failures (raising, NaN/inf, a non-number, a wrong-length list, exceeding RewardConfig.timeout_s)
follow RewardConfig.on_failure: "raise" stops the run with RewardPluginError; "drop" drops the
sample from its group (reward NaN, keep False) and counts it in RewardResult.failure_counts.
A failure is never scored as zero. See `runner` for the details, including threads that linger
after a sync function times out.

Use:
    config = RewardConfig(fn="math_final_answer", timeout_s=5.0, on_failure="drop")
    plugin = load_plugin(config)             # once, at start-up: bad references fail here
    result = score(samples, config, plugin)  # every step
    result.rewards, result.keep, result.failure_counts
"""

from miles_k3.data.sample import Sample
from miles_k3.rewards.builtin import BUILTINS, arithmetic, exact_match
from miles_k3.rewards.config import RewardConfig
from miles_k3.rewards.math_answer import answers_match, extract_final_answer, math_final_answer
from miles_k3.rewards.plugin import ENTRY_POINT_GROUP, RewardPlugin, as_plugin, batched, known_names, load_plugin
from miles_k3.rewards.remote import RemoteReward, RemoteRewardError, RemoteRewardTimeout
from miles_k3.rewards.runner import (
    FAILURE_KINDS,
    Failure,
    RewardPluginError,
    RewardResult,
    score,
    score_async,
)

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "FAILURE_KINDS",
    "Failure",
    "RemoteReward",
    "RemoteRewardError",
    "RemoteRewardTimeout",
    "RewardConfig",
    "RewardPlugin",
    "RewardPluginError",
    "RewardResult",
    "Sample",
    "answers_match",
    "arithmetic",
    "as_plugin",
    "batched",
    "exact_match",
    "extract_final_answer",
    "known_names",
    "load_plugin",
    "math_final_answer",
    "score",
    "score_async",
]
