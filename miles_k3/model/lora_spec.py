"""LoraSpec: which K3 modules carry a LoRA adapter, and its rank, alpha and dropout.

One spec serves the trainer (`megatron_patches`), the engine (`rollout.lora`) and PEFT export, so
the three agree on what is adapted. Targets are regexes searched (`re.search`) in HF module names
without wrapper prefix; routed experts are matched per projection as `<prefix>.experts.w1` (gate),
`.w3` (up), `.w2` (down), one stacked adapter per projection covering every expert.

The adapter's contribution to a module's output is `scale * B(A x)` with `scale = alpha / rank`
(PEFT's default, non-rslora scaling); dropout applies to the adapter's input x only.

`adaptable_modules(config)` names every module a K3 model can adapt, read off its tensor layout without
building it, so `check_matches` can reject targets that select nothing before any model exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from miles_k3.model.config import K3Config
from miles_k3.model.layout import tensor_shapes

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
    """Checked on construction: ValueError starting with `LoraSpec.<field>`."""

    rank: int = 8  # >= 1: the adapter's inner dimension r (A is [r, in], B is [out, r])
    alpha: float = 16.0  # > 0: the output is scaled by alpha / rank
    dropout: float = 0.0  # in [0, 1): dropout on the adapter's input while training
    targets: tuple[str, ...] = DEFAULT_TARGETS  # regexes searched in HF module names (module docstring)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSpec.rank must be an int >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraSpec.alpha must be a number > 0, got {self.alpha!r}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
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

    def check_matches(self, modules: Iterable[str]) -> None:
        """ValueError unless the targets select at least one of `modules` (e.g. `adaptable_modules(config)`)
        and, for targets other than the default set, every pattern selects one: a typo in one of several
        patterns would otherwise drop its modules silently. (The default set spans the whole K3 family, so
        some of its patterns match nothing in a given model.)"""
        modules = list(modules)
        example = f"modules are named like {modules[0]!r}" if modules else "the model has no adaptable module"
        if not any(self.targets_module(m) for m in modules):
            raise ValueError(f"LoraSpec.targets match no module of this model ({example}), got {self.targets!r}")
        if self.targets != DEFAULT_TARGETS:
            for t in self.targets:
                if not any(re.search(t, m) for m in modules):
                    raise ValueError(f"LoraSpec.targets: {t!r} matches no module of this model ({example})")


def matches_targets(targets: tuple[str, ...], name: str) -> bool:
    return any(re.search(t, name) for t in targets)


# Two-dimensional weights that are not linear projections: the embedding, the MoE router, AttnRes queries.
_NOT_LINEAR = re.compile(r"(^model\.embed_tokens|\.block_sparse_moe\.gate|_res_proj)\.weight$")
_EXPERT = re.compile(r"\.experts\.\d+\.(w[123])\.weight$")


def adaptable_modules(config: K3Config) -> list[str]:
    """HF names (no wrapper prefix) of every module of `config`'s model that can carry an adapter, in layout
    order: each linear projection (lm_head included) and, per MoE layer, the stacked routed-expert
    projections `<prefix>.experts.w1`, `.w2`, `.w3`."""
    names: dict[str, None] = {}
    for tensor, shape in tensor_shapes(config).items():
        if len(shape) != 2 or not tensor.endswith(".weight") or _NOT_LINEAR.search(tensor):
            continue
        expert = _EXPERT.search(tensor)
        module = tensor[: expert.start()] + f".experts.{expert.group(1)}" if expert else tensor[: -len(".weight")]
        names[module] = None
    return list(names)


# The naming an adapter file uses for the model family of its checkpoint (`miles_k3.model.peft`).
FAMILY_K3 = "k3"  # K3's published modeling code: block_sparse_moe.*, self_attn.f_a_proj, one module per expert
FAMILY_KIMI_LINEAR = "kimi_linear"  # transformers' KimiLinearForCausalLM: mlp.*, forget_gate.*, stacked experts
ADAPTER_FAMILIES = (FAMILY_K3, FAMILY_KIMI_LINEAR)


def adapter_family(config: K3Config) -> str:
    """The family whose module names a PEFT adapter of `config`'s model is written in: `kimi_linear` when the
    config is the Kimi-Linear form (none of K3's features, no VL wrapper: transformers' own
    `KimiLinearForCausalLM` runs it), else `k3`. Quantized experts and q-LoRA do not change the naming."""
    same = config.kimi_linear_form().replace(
        q_lora_rank=config.q_lora_rank, experts_mxfp4=config.experts_mxfp4, hf_wrapper_extras=config.hf_wrapper_extras
    )
    return FAMILY_KIMI_LINEAR if same == config else FAMILY_K3


_LAYER = re.compile(r"^model\.layers\.\d+\.")
_KNOWN_SUFFIXES: frozenset[str] | None = None


def is_adaptable_name(name: str) -> bool:
    """Whether `name` (engine naming, no wrapper prefix) is a module some K3-family model can adapt: `lm_head`
    or `model.layers.<i>.<m>` with `<m>` a module of any K3 / Kimi-Linear layer (KDA or MLA mixer, dense MLP,
    shared or routed experts, LatentMoE projections). It does not check a layer index against a config."""
    global _KNOWN_SUFFIXES
    if _KNOWN_SUFFIXES is None:
        tiny = K3Config.from_preset("k3-tiny")
        variants = (
            tiny,
            tiny.kimi_linear_form(),
            tiny.replace(q_lora_rank=None),
            tiny.kimi_linear_form().replace(q_lora_rank=16, kda_output_gate="full"),
        )
        _KNOWN_SUFFIXES = frozenset(_LAYER.sub("", m) for c in variants for m in adaptable_modules(c))
    return _LAYER.sub("", name) in _KNOWN_SUFFIXES if _LAYER.match(name) or name == "lm_head" else False
