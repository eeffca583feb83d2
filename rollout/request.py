"""Requests and sampling parameters: what a caller submits and what it gets back."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

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
    # alternatives under the same distribution as the sampled token's log-prob, computed from the same logits:
    top_logprobs: int = 0  # >= 0: per output token, the N most likely (token id, log-prob) (Completion.top_logprobs)
    token_ids_logprob: tuple[int, ...] = ()  # per output token, the log-probs of these ids (token_ids_logprobs)
    logprob_start_len: int = -1  # >= 0: prompt log-probs from this prompt position (Completion.prompt); -1: none

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
        integer("top_logprobs", 0)
        ids = self.token_ids_logprob
        if not isinstance(ids, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids
        ):
            raise fail("token_ids_logprob", "must be a list of token ids (integers >= 0)")
        object.__setattr__(self, "token_ids_logprob", tuple(ids))
        integer("logprob_start_len", -1)

    @property
    def alternatives(self) -> bool:
        """Whether each sampled token also reports alternatives (top log-probs or given ids' log-probs)."""
        return self.top_logprobs > 0 or bool(self.token_ids_logprob)


class TokenEvent(NamedTuple):
    """One sampled token as a stream hands it over (`Engine.take_events`). `top` / `ids`: the request's top
    log-probs / its token_ids_logprob log-probs at this position (None when not asked); `prompt`: on a request's
    first output token, its prompt log-probs when asked (`SamplingParams.logprob_start_len`)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None
    ids: list[float] | None = None
    prompt: PromptLogprobs | None = None


@dataclass
class PromptLogprobs:
    """Log-probs of a request's prompt tokens from position `start` on, each under the distribution the model
    gave it after the tokens before it (the request's temperature, 1 when greedy, untruncated), computed in the
    prefill. Position 0 has no distribution: its entries are None. `top` / `token_ids` as the output tokens'
    (None when not asked)."""

    start: int
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] | None = None
    token_ids: list[list[float] | None] | None = None


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
    # with SamplingParams.top_logprobs: per output token its top (token id, log-prob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # with SamplingParams.token_ids_logprob: per output token the log-probs of those ids, in their order
    token_ids_logprobs: list[list[float]] | None = None
    prompt: PromptLogprobs | None = None  # with SamplingParams.logprob_start_len >= 0
    # with EngineConfig.record_routing: [len(prompt_ids) + len(output_ids), MoE layers, top_k] int16 expert ids
    # of each token as the engine computed it; -1 for a token never fed (the last output token). None otherwise
    routed_experts: object | None = None


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
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # with params.top_logprobs
    token_ids_logprobs: list[list[float]] = field(default_factory=list)  # with params.token_ids_logprob
    prompt_lp: PromptLogprobs | None = None  # filled by the prefill (params.logprob_start_len >= 0)
    # (top, ids) of each token the step being read back sampled, set just before the engine appends them
    step_alternatives: list[tuple[list[tuple[int, float]] | None, list[float] | None]] | None = None

    @property
    def prompt_logprob_next(self) -> int | None:
        """The next prompt position whose log-prob is still to be computed; None when none is (not asked, or
        done). A prefix-cache hit must not skip the logits row before it (`Scheduler._admit`)."""
        if self.params.logprob_start_len < 0:
            return None
        done = self.prompt_lp.start + len(self.prompt_lp.logprobs) if self.prompt_lp else self.params.logprob_start_len
        return done if done < len(self.prompt_ids) else None

    routed_experts: object | None = None  # set when it finishes, with EngineConfig.record_routing (Completion's)

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
            top_logprobs=[list(t) for t in self.top_logprobs] if self.params.top_logprobs else None,
            token_ids_logprobs=[list(t) for t in self.token_ids_logprobs] if self.params.token_ids_logprob else None,
            prompt=self.prompt_lp,
            routed_experts=self.routed_experts,
        )
