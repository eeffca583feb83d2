"""SpecConfig: the speculative-decoding settings `EngineConfig.speculation` takes, with their defaults and checks.

    Engine(model, EngineConfig(memory_bytes=64 << 20, speculation=SpecConfig(drafter="path/to/drafter")))

Invalid values raise ValueError on construction, the message starting with `SpecConfig.<field>`; a drafter
directory is read (and its files checked) when the engine builds its decode strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollout.spec import drafter as drafters
from rollout.spec.drafter import Drafter

PLANNERS = ("verify_all", "cost_aware")
ROLLBACKS = ("replay", "snapshot")


@dataclass(frozen=True, eq=False)
class SpecConfig:
    """Draft `gamma` tokens per request, verify gamma + 1 in one target forward, keep a prefix (lossless)."""

    # the drafter: a directory holding a DSpark drafter (`config.json` + `model.safetensors`, written by
    # scripts/train_drafter.py), or a `Drafter` instance (tests, a drafter built in the same process)
    drafter: str | Path | Drafter
    # drafts per block; one verify step feeds the anchor and these, so a row may advance 1..gamma + 1 tokens
    # per step and its pages must cover gamma + 1 positions past its computed ones (`lookahead`)
    gamma: int = 4
    # how many of each row's drafts a verify step checks: "verify_all" (gamma per row), or "cost_aware"
    # (rollout.spec.planner: a token budget from the previous step's confidences against a step cost
    # surface measured when the engine starts and priced by its own steps, filled by the current
    # confidences; none where no block pays: a plain step; needs a drafter with a confidence head)
    planner: str = "verify_all"
    # how a verify step's KDA state gets back to the accepted length: "replay" (ReplaySSM: the verify pass
    # never writes the state; a fold replays the accepted tokens' stored inputs, rollout.spec.replay) or
    # "snapshot" (the baseline it replaces: a full state snapshot after every draft step, the accepted
    # one kept, rollout.spec.snapshot); both commit the same state
    rollback: str = "replay"
    # speculate only while the decode batch has at most this many rows; a larger batch decodes one token a row
    # per step (the plain decode step, its graphs capturing the drafter's taps so its context stays current),
    # since there a block of gamma + 1 tokens costs about its tokens' worth (one H200, k3-small, 2026-12-04:
    # 1.6x plain decoding at batch 1, 0.9x at 64, 0.47x at 256); None: every step speculates
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, (str, Path, Drafter)):
            raise ValueError(
                f"SpecConfig.drafter must be a drafter directory or a Drafter, got {type(self.drafter).__name__}"
            )
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"SpecConfig.gamma must be an integer >= 1, got {self.gamma!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"SpecConfig.planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"SpecConfig.rollback must be one of {ROLLBACKS}, got {self.rollback!r}")
        if self.max_batch is not None and (
            isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1
        ):
            raise ValueError(
                f"SpecConfig.max_batch must be an integer >= 1 (None: every step speculates), got {self.max_batch!r}"
            )

    def __eq__(self, other) -> bool:
        """Field by field, a `Drafter` instance by its class: each rank of a sharded engine builds its own
        (the engine checks every rank's EngineConfig against the leader's)."""
        if not isinstance(other, SpecConfig):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        drafter = type(self.drafter).__qualname__ if isinstance(self.drafter, Drafter) else str(self.drafter)
        return drafter, self.gamma, self.planner, self.rollback, self.max_batch

    def build_drafter(self, runner) -> Drafter:
        """The drafter for the engine's `ModelRunner`, loaded when `drafter` is a directory."""
        if isinstance(self.drafter, Drafter):
            drafter = self.drafter
        else:
            drafter = drafters.DSparkDrafter.load(self.drafter, runner.model)
        if self.gamma > drafter.max_gamma:
            raise ValueError(f"SpecConfig.gamma ({self.gamma}) exceeds the drafter's block ({drafter.max_gamma})")
        if self.planner == "cost_aware" and not drafter.has_confidence:
            raise ValueError(
                "SpecConfig.planner='cost_aware' needs a drafter with a confidence head "
                f"({type(drafter).__name__} has none)"
            )
        drafter.attach(runner)
        return drafter
