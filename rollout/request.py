"""Requests and sampling parameters: what a caller submits and what it gets back."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.media import PromptMedia

_ids = itertools.count()


def next_request_id() -> int:
    """A request id no other request of this process has."""
    return next(_ids)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Log-probs are always those of the sampled token under the *untruncated*
    distribution at this temperature (temperature 1 when greedy). Checked on construction: ValueError
    starting with `SamplingParams.<field>`."""

    temperature: float = 1.0  # >= 0 and finite; 0 is greedy (argmax)
    top_p: float = 1.0  # in (0, 1]: sample from the smallest top set whose mass reaches top_p; 1.0 disables it
    top_k: int = 0  # >= 0: sample from the k most likely tokens; 0 (or >= the vocabulary) disables it
    max_new_tokens: int = 128  # >= 1: the most tokens generated for the request
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting any of these (it is kept)
    seed: int | None = None  # reproducible samples (`rollout.noise`, taken mod 2^62); None: drawn from torch's stream
    return_logprobs: bool = True  # Completion.logprobs holds one log-prob per output token (else None)

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise fail(name, "must be a finite number")
            return value

        def integer(name: str, low: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise fail(name, f"must be an integer >= {low}")

        if number("temperature") < 0:
            raise fail("temperature", "must be >= 0 (0 is greedy)")
        if not 0.0 < number("top_p") <= 1.0:
            raise fail("top_p", "must be in (0, 1] (1.0 disables it)")
        integer("top_k", 0)
        integer("max_new_tokens", 1)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise fail("seed", "must be an integer or None")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class Completion:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    cached_tokens: int  # prompt tokens served from the prefix cache at (last) admission


@dataclass(eq=False)
class Request:
    """Engine-side state of one request. Owned by the scheduler; callers see `Completion`s."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    request_id: int = field(default_factory=next_request_id)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    retractions: int = 0
    media: PromptMedia | None = None  # the prompt's images (`rollout.media`): features at its pad tokens
    seed: int = 0  # the sampling noise's seed (`rollout.noise`): params.seed, or drawn by the engine at submit

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cache_keys(self, tokens: list[int]) -> list[int]:
        """`tokens` (this request's prompt, then outputs) as its prefix tree keys them: the ids themselves, with
        the prompt's media pads replaced by their images' keys (`rollout.media`)."""
        return tokens if self.media is None else self.media.keys(tokens)

    def completion(self) -> Completion:
        return Completion(
            self.request_id,
            list(self.prompt_ids),
            list(self.output_ids),
            list(self.logprobs) if self.params.return_logprobs else None,
            self.finish_reason,
            self.cached_tokens,
        )
