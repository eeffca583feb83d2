"""LoraSpec: which K3 modules carry a LoRA adapter, and its rank, alpha and dropout.

One spec serves the trainer (`megatron_patches`), the engine (`rollout.lora`) and PEFT export, so
the three agree on what is adapted. Targets are regexes searched (`re.search`) in HF module names
without wrapper prefix; routed experts are matched per projection as `<prefix>.experts.w1` (gate),
`.w3` (up), `.w2` (down), one stacked adapter per projection covering every expert.

The adapter's contribution to a module's output is `scale * B(A x)` with `scale = alpha / rank`
(PEFT's default, non-rslora scaling); dropout applies to the adapter's input x only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# KDA q/k/v/o and output gate, MLA q_b/kv_b/o and output gate (MLA's q_proj when q_lora_rank is None),
# the dense MLP, shared experts, the LatentMoE down/up projections and every routed expert projection.
DEFAULT_TARGETS: tuple[str, ...] = (
    r"self_attn\.(q|k|v|o|g|q_b|kv_b)_proj$",
    r"mlp\.(gate|up|down)_proj$",
    r"shared_experts\.(gate|up|down)_proj$",
    r"routed_expert_(down|up)_proj$",
    r"experts\.w[123]$",
)


@dataclass(frozen=True)
class LoraSpec:
    """rank >= 1, alpha > 0, dropout in [0, 1), targets: non-empty tuple of valid regexes."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSpec.rank must be an int >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraSpec.alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSpec.dropout must lie in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str) or not isinstance(self.targets, (tuple, list)):
            raise ValueError(f"LoraSpec.targets must be a tuple of regex strings, got {self.targets!r}")
        # a list (e.g. from a Hydra config) is accepted and frozen into a tuple
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ValueError("LoraSpec.targets must name at least one module pattern")
        for t in self.targets:
            if not isinstance(t, str) or not t:
                raise ValueError(f"LoraSpec.targets: every entry must be a non-empty regex string, got {t!r}")
            try:
                re.compile(t)
            except re.error as e:
                raise ValueError(f"LoraSpec.targets: bad regex {t!r}: {e}") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets_module(self, name: str) -> bool:
        """Whether the HF module `name` (stacked experts: `<prefix>.experts.w1`) gets an adapter."""
        return matches_targets(self.targets, name)


def matches_targets(targets: tuple[str, ...], name: str) -> bool:
    return any(re.search(t, name) for t in targets)
