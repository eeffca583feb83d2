"""Sample: one rollout sample, the single record from the engine to the optimizer.

The driver makes one per sample (its prompt, label, metadata and place in its group), the rollout backend
fills in what the engine produced (output ids, the engine's log-prob of each, the finish reason, per-token
extras), a multi-turn rollout function appends its turns to it, the reward function reads it, the loop sets
its reward and advantage, and the train batch is a list of them (`miles_k3.trainer.batch.TrainBatch`). No hop
re-types it, so a field added here reaches the loss without being threaded through each layer.

Per-token fields are aligned with `output_ids`: `logprobs`, `loss_mask`, and every list in `token_fields`,
the room for further per-token data (an adapter version). `check` holds them to that length, so a field
cannot be silently short. `routed_experts` covers the whole sequence (prompt and output: the trainer replays
the routing of every token it forwards), a tensor [tokens, MoE layers, top_k] (`miles_k3.model.routing`).

What a reward function sees (`miles_k3.rewards`): `prompt` and `response` (the text the policy saw and wrote),
`label`, `metadata`, `group_index`, `sample_index`; under K3's chat encoding (data.chat_template=k3) `response`
is the reply's response channel, `reasoning` its think channel and `tool_calls` its parsed tool calls
(`miles_k3.data.k3_chat`). It must treat the sample as read-only: the trainer reads the same object afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class SequenceMedia(NamedTuple):
    """A prompt's images: the prompt positions of its media pad tokens (ascending) and one image per run of
    pads, in pad order (`rollout.media.ImageFeatures`: the projected features the engine splices in and the
    trainer's row takes, computed once per prompt and shared by its samples)."""

    positions: tuple[int, ...]
    images: tuple[Any, ...]

    @property
    def features(self) -> torch.Tensor:
        """The pads' feature rows [len(positions), D], image after image."""
        return torch.cat([image.features for image in self.images])


@dataclass(eq=False)
class Sample:
    """One sample (module docstring). The first six fields are what a reward function reads; the rest are
    filled by the rollout and the loop."""

    prompt: str  # the prompt's text as the dataset gives it
    response: str | None = None  # what the reward scores; None until set: the decoded output
    label: Any = None  # the dataset's reference answer (any JSON-able value)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the row's other keys, untouched
    group_index: int = 0  # the prompt group (GRPO group) in this step
    sample_index: int = 0  # the position inside the group
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as the engine and the trainer read it
    output_ids: list[int] = field(default_factory=list)  # the response's tokens
    logprobs: list[float] = field(default_factory=list)  # per output token: the engine's (0.0 where masked)
    loss_mask: list[bool] = field(default_factory=list)  # per output token: True = the policy's (carries loss)
    finish_reason: str = ""  # the last generation's: "stop" | "length" | "abort"
    media: SequenceMedia | None = None  # the prompt's images (None: a text prompt)
    token_fields: dict[str, list] = field(default_factory=dict)  # further per-token data, by name
    # the engine's expert ids of each token of prompt_ids + output_ids [<= tokens, MoE layers, top_k] (int16,
    # -1: no record; rows past its end: none either); None: not recorded (rollout.record_routing off)
    routed_experts: torch.Tensor | None = None
    # the adapter that generated it, where the backend tags it (rollout.backend=http): the run's n-th adapter sync
    # (1: the first); the loop trains it only while at most rollout.max_staleness syncs old
    policy_version: int | None = None
    # K3's chat encoding (miles_k3.data.k3_chat.read_reply): the reply's think channel (None: none, or not K3
    # chat) and its tool calls (miles_k3.data.k3_chat.ToolCall), parsed from the output ids with `response`
    reasoning: str | None = None
    tool_calls: list = field(default_factory=list)
    reward: float | None = None  # set by the loop once scored (NaN: the reward failed and the sample dropped)
    advantage: float = 0.0  # set by the loop: the group-normalized advantage

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise TypeError(f"Sample.prompt must be str, got {type(self.prompt).__name__}")
        if self.response is not None and not isinstance(self.response, str):
            raise TypeError(f"Sample.response must be str, got {type(self.response).__name__}")
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"Sample.metadata must be a mapping, got {type(self.metadata).__name__}")

    @property
    def where(self) -> str:
        """Human-readable position, used in failure messages."""
        return f"group {self.group_index} sample {self.sample_index}"

    @property
    def ids(self) -> list[int]:
        """Everything so far (prompt + output): a multi-turn rollout's next context."""
        return self.prompt_ids + self.output_ids

    @property
    def policy_tokens(self) -> int:
        """Output tokens that carry loss."""
        return sum(self.loss_mask)

    def to_json(self) -> dict[str, Any]:
        """The JSON object a remote reward server receives for this sample (`reasoning` and `tool_calls` only
        when the reply has them)."""
        return {
            "prompt": self.prompt,
            "response": self.response,
            "label": self.label,
            "metadata": dict(self.metadata),
            "group_index": self.group_index,
            "sample_index": self.sample_index,
            # K3's chat encoding only: the think channel and the tool calls in OpenAI's function shape
            **({"reasoning": self.reasoning} if self.reasoning is not None else {}),
            **(
                {"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in self.tool_calls]}
                if self.tool_calls
                else {}
            ),
        }

    # ------------------------------------------------------------ building the output
    def add_policy(self, turn: Sample) -> None:
        """Append a generation of the policy's (`turn.output_ids`, with the engine's log-probs and per-token
        fields): every token carries loss."""
        n = len(turn.output_ids)
        self._pad_fields(turn.token_fields)
        for name, values in turn.token_fields.items():
            self.token_fields[name] += list(values)
        self._pad_fields({}, len(self.output_ids) + n)
        if turn.routed_experts is not None:  # the turn's context is this sample's ids: its table covers them all
            self.routed_experts = turn.routed_experts
        self.output_ids += turn.output_ids
        self.logprobs += list(turn.logprobs)
        self.loss_mask += [True] * n
        self.finish_reason = turn.finish_reason

    def add_environment(self, token_ids: list[int]) -> None:
        """Append tokens the model reads but did not write (a tool's output): no loss, log-prob 0.0, None in
        every per-token field."""
        self.output_ids += list(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.loss_mask += [False] * len(token_ids)
        self._pad_fields({}, len(self.output_ids))

    def _pad_fields(self, names, length: int | None = None) -> None:
        """Every per-token field (and each of `names`, created) filled with None up to `length` (default: the
        output so far)."""
        length = len(self.output_ids) if length is None else length
        for name in names:
            self.token_fields.setdefault(name, [])
        for values in self.token_fields.values():
            values += [None] * (length - len(values))

    def check(self, vocab_size: int) -> None:
        """ValueError saying what is wrong with a sample the trainer cannot use."""
        if not self.prompt_ids:
            raise ValueError("empty prompt_ids")
        n = len(self.output_ids)
        lengths = {
            "logprobs": len(self.logprobs),
            "loss_mask": len(self.loss_mask),
            **{f"token_fields[{k!r}]": len(v) for k, v in self.token_fields.items()},
        }
        short = {k: v for k, v in lengths.items() if v != n}
        if short:
            raise ValueError(
                f"{n} output tokens, but "
                + ", ".join(f"{v} {k}" for k, v in short.items())
                + " (one each per output token)"
            )
        for name, ids in (("prompt_ids", self.prompt_ids), ("output_ids", self.output_ids)):
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} holds {bad[0]!r}, not a token id of the model's vocabulary ({vocab_size})")
        for lp, keep in zip(self.logprobs, self.loss_mask):
            if keep and not (isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= 0.0):
                raise ValueError(f"a policy token's log-prob is {lp!r} (the engine's: finite, <= 0)")
        if self.response is not None and not isinstance(self.response, str):
            raise ValueError(f"response must be a string or None, got {type(self.response).__name__}")
        r = self.routed_experts
        if r is not None and (not torch.is_tensor(r) or r.dim() != 3 or r.shape[0] > len(self.ids)):
            shape = tuple(r.shape) if torch.is_tensor(r) else type(r).__name__
            raise ValueError(f"routed_experts must be a [<= {len(self.ids)} tokens, layers, top_k] tensor, got {shape}")
