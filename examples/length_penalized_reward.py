"""A custom reward plugin: the arithmetic checker, minus a small penalty per character beyond the answer.

Use it from any directory where this file is importable (e.g. PYTHONPATH=examples):

    miles-train recipe=k3_grpo reward.fn=length_penalized_reward:score reward.on_failure=drop

A plugin is a plain function `Sample -> float` (or `@batched` `list[Sample] -> list[float]`, or `async def`).
Raising, returning NaN, or running past reward.timeout_s drops the sample (on_failure=drop, counted in the
`reward_failures_*` metrics) or stops the run (on_failure=raise); it is never scored as zero.
"""

from miles_k3.rewards import Sample
from miles_k3.tasks.arithmetic import check_answer


def score(sample: Sample) -> float:
    correct = 1.0 if check_answer(sample.response, sample.label) else 0.0
    extra = max(0, len(sample.response.strip()) - len(str(sample.label)))
    return correct - 0.05 * extra
