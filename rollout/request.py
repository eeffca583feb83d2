"""Requests and sampling parameters: what a caller submits and what it gets back."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable truncation. Log-probs are always those of the
    sampled token under the *untruncated* distribution at this temperature (temperature 1 when greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    return_logprobs: bool = True

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
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
    request_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    retractions: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def completion(self) -> Completion:
        return Completion(self.request_id, list(self.prompt_ids), list(self.output_ids),
                          list(self.logprobs) if self.params.return_logprobs else None,
                          self.finish_reason, self.cached_tokens)
