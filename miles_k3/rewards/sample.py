"""Sample: what a reward function sees, one generated response and its context."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One response to score.

    prompt / response: the decoded text the policy saw and wrote.
    label: the dataset's reference answer (any JSON-able value); None when the dataset has none.
    metadata: the dataset row's extra keys, passed through untouched (JSON-able for remote rewards).
    group_index: which prompt group (GRPO group) the sample belongs to in this batch.
    sample_index: the sample's position inside its group.

    Frozen so a plugin cannot change what the trainer later reads; `metadata` itself is the
    caller's mapping, so plugins must treat it as read-only too.
    """

    prompt: str
    response: str
    label: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    group_index: int = 0
    sample_index: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise TypeError(f"Sample.prompt must be str, got {type(self.prompt).__name__}")
        if not isinstance(self.response, str):
            raise TypeError(f"Sample.response must be str, got {type(self.response).__name__}")
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"Sample.metadata must be a mapping, got {type(self.metadata).__name__}")

    @property
    def where(self) -> str:
        """Human-readable position, used in failure messages."""
        return f"group {self.group_index} sample {self.sample_index}"

    def to_json(self) -> dict[str, Any]:
        """The JSON object a remote reward server receives for this sample."""
        return {
            "prompt": self.prompt,
            "response": self.response,
            "label": self.label,
            "metadata": dict(self.metadata),
            "group_index": self.group_index,
            "sample_index": self.sample_index,
        }
