"""Built-in reward functions, registered under short names in `BUILTINS`.

exact_match: 1.0 when the whole response equals the label after normalization (Unicode NFKC,
    case folded, runs of whitespace collapsed, ends stripped, one trailing period dropped);
    a list label accepts any of its items.
math_final_answer: see `math_answer`.
arithmetic: the synthetic task's checker (the tiny-K3 recipe): `miles_k3.tasks.arithmetic.
    check_answer`, so that reward and held-out evaluation can never disagree. The response's
    last integer must equal the label (int, integral float or integer string).
squares: the visual task's checker (the tiny vision-language recipe, `miles_k3.tasks.squares.
    count_reward`): the response's last integer must be the count of squares of the asked colour.
remote: see `remote.RemoteReward`; the only built-in that needs options from RewardConfig.

All of them raise (a plugin failure, handled by the failure policy) when a sample's label is
missing or malformed: a data error is never turned into a zero reward.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

from miles_k3.data.sample import Sample
from miles_k3.rewards.config import REMOTE, RewardConfig
from miles_k3.rewards.math_answer import math_final_answer
from miles_k3.rewards.remote import RemoteReward
from miles_k3.tasks.arithmetic import check_answer
from miles_k3.tasks.squares import count_reward


def normalize_text(text: str) -> str:
    """exact_match's normal form."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.removesuffix(".").rstrip()


def exact_match(sample: Sample) -> float:
    """1.0 when the normalized response equals the normalized label (or one of a list's items)."""
    label = sample.label
    if label is None:
        raise ValueError("exact_match needs a label; this sample has none")
    options = label if isinstance(label, (list, tuple)) else [label]
    if not options or not all(isinstance(o, (str, int, float)) and not isinstance(o, bool) for o in options):
        raise ValueError(
            f"exact_match: the label must be a string or number, or a non-empty list of them; got {label!r}"
        )
    response = normalize_text(sample.response)
    return 1.0 if any(response == normalize_text(str(option)) for option in options) else 0.0


def arithmetic(sample: Sample) -> float:
    """1.0 when the response's last integer is the label, else 0.0 (the task's own checker)."""
    return 1.0 if check_answer(sample.response, sample.label) else 0.0


def _plain(fn: Callable[[Sample], float]) -> Callable[[RewardConfig], Callable[..., Any]]:
    return lambda config: fn


# name -> factory(config) -> reward function. Only the remote reward reads the config.
BUILTINS: dict[str, Callable[[RewardConfig], Callable[..., Any]]] = {
    "exact_match": _plain(exact_match),
    "math_final_answer": _plain(math_final_answer),
    "arithmetic": _plain(arithmetic),
    "squares": _plain(count_reward),
    REMOTE: RemoteReward.from_config,
}
