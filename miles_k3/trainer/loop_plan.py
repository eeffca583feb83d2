"""The colocated RL loop's memory per GPU and per phase: one trainer rank and one engine shard on every GPU.

    stages = LayoutPlanner(config, lora).stages(layout, tokens, recompute=True)     # the trainer's ranks
    shard = engine_shard_bytes(config, EngineLayout(16, 1, True), quantize="all", lora=lora)
    engine = EngineOnGPU(EngineLayout(16, 1, True), shard, pools=..., graphs=...)
    plan = loop_plan(layout, stages, engine, Offloads(optimizer=True), recompute=True)
    plan.rollout.total, plan.training.total, plan.fullest, plan.fits(limit), plan.overrides(tokens, "all")

Every GPU holds one rank of the trainer's layout (`megatron_patches.layout_plan`: the ranks of one pipeline
stage hold the same bytes) and one shard of an engine replica (`rollout.shard_plan`: every shard holds the
same bytes). A phase's figure is its fullest GPU, the stage that maximizes it (the two phases may peak on
different stages).

- rollout: the engine shard's weights and adapter pool, its KV / KDA pools and the CUDA-graph allowance, plus
  what the trainer keeps on the GPU while the engine samples: its base weights (unless `parallel.offload_base`),
  its LoRA parameters (always) and AdamW state (unless `parallel.offload_optimizer`). Gradients are freed
  after each step (`zero_grad(set_to_none=True)`), activations exist only in training.
- training: the trainer's whole rank (base, LoRA, gradients, AdamW, activations of the micro-batches in flight
  and, with recompute, the one layer rebuilt) plus what the engine keeps: its adapter pool (the adapter sync
  writes it in place) and its weights unless `rollout.offload_weights`. The pools and the graphs that read
  them are released (`rollout.release_memory`).

`moved` is what the chosen offloads copy to the host and back each step on the GPU that moves the most. `best`
takes, among the plans that fit, one without recompute if any, then the fewest offloads, the fewest bytes
moved, the smallest engine TP and DCP (fitting is what memory decides; past that, more engine replicas and
smaller decode collectives are faster), and last the lowest peak.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from rollout.shard_plan import EngineLayout, EngineShardBytes

if TYPE_CHECKING:  # annotations only: parsing --offload needs no megatron import
    from megatron_patches.layout_plan import Layout, StageBytes

# Offloads.<field> -> its config key (the keys the loop's runtime reads)
OFFLOAD_KEYS = {
    "optimizer": "parallel.offload_optimizer",
    "base": "parallel.offload_base",
    "engine": "rollout.offload_weights",
}


@dataclass(frozen=True)
class Offloads:
    """What goes to the host for one phase: `optimizer` the trainer's AdamW state and `base` its base weights
    during rollout; `engine` the engine's weights during training."""

    optimizer: bool = False
    base: bool = False
    engine: bool = False

    @property
    def count(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def __str__(self) -> str:
        return "+".join(f.name for f in fields(self) if getattr(self, f.name)) or "none"

    def overrides(self) -> list[str]:
        """The config overrides that turn these offloads on (those off are left at their default, false)."""
        return [f"{OFFLOAD_KEYS[f.name]}=true" for f in fields(self) if getattr(self, f.name)]

    @classmethod
    def parse(cls, text: str) -> "Offloads":
        """ "none", "all" or names joined by "+" (optimizer, base, engine); ValueError names --offload."""
        names = [n.strip() for n in text.split("+")]
        if names == ["none"]:
            return cls()
        if names == ["all"]:
            return cls(True, True, True)
        if not all(n in OFFLOAD_KEYS for n in names) or len(set(names)) != len(names):
            raise ValueError(
                f"--offload {text!r}: expected none, all, or names joined by '+' from {', '.join(OFFLOAD_KEYS)}"
            )
        return cls(**{n: True for n in names})

    @classmethod
    def every(cls) -> list["Offloads"]:
        """Every combination, fewest offloads first."""
        combos = [cls(*bits) for bits in itertools.product((False, True), repeat=len(OFFLOAD_KEYS))]
        return sorted(combos, key=lambda o: o.count)


@dataclass(frozen=True)
class EngineOnGPU:
    """One engine shard on its GPU during rollout: its weights and adapters (`rollout.shard_plan`), its KV pages
    and KDA state slots (`pools`) and the CUDA-graph allowance (`graphs`), bytes."""

    layout: EngineLayout
    shard: EngineShardBytes
    pools: int
    graphs: int


@dataclass(frozen=True)
class Phase:
    """One phase on its fullest GPU: the trainer `stage` that GPU runs and its bytes by part (name, bytes)."""

    stage: int
    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.parts)

    def __getitem__(self, name: str) -> int:
        return dict(self.parts)[name]


@dataclass(frozen=True)
class LoopPlan:
    """Both phases of one candidate (trainer layout, engine layout, offloads, recompute), per GPU."""

    layout: Layout
    engine: EngineOnGPU
    offloads: Offloads
    recompute: bool
    rollout: Phase
    training: Phase
    moved: int  # bytes the offloads copy to the host and back each step, on the GPU that moves the most

    @property
    def peak(self) -> int:
        return max(self.rollout.total, self.training.total)

    @property
    def fullest(self) -> str:
        """The phase that needs the most memory: "rollout" or "training"."""
        return "rollout" if self.rollout.total >= self.training.total else "training"

    def fits(self, limit: float) -> bool:
        return self.peak <= limit

    def rank_key(self) -> tuple:
        """Lower is better: no recompute, the fewest offloads, the fewest bytes moved, the fewest engine TP
        ranks (more replicas, a collective over fewer ranks per decode step), no DCP, the lowest peak."""
        lay = self.engine.layout
        return (self.recompute, self.offloads.count, self.moved, lay.tp, lay.dcp, self.peak)

    def overrides(self, micro_batch_tokens: int, quantize: str, memory_mb: int | None = None) -> str:
        """The recipe overrides that run this plan: the trainer's layout (parallel.*), its micro-batch size and
        recompute, the engine's layout, quantization and bf16 (rollout.*; the plan counts bf16 on both sides:
        model.train_dtype too), the pools' budget per GPU (rollout.memory_mb, when given) and the offloads that
        are on."""
        lay = self.layout
        parts = [
            f"parallel.tp={lay.tp} parallel.pp={lay.pp} parallel.cp={lay.cp} parallel.ep={lay.ep} parallel.dp={lay.dp}",
            f"parallel.micro_batch_tokens={micro_batch_tokens} parallel.recompute={str(self.recompute).lower()}",
            self.engine.layout.overrides(),
            f"rollout.quantize={quantize} rollout.dtype=bfloat16 model.train_dtype=bfloat16",
            *([f"rollout.memory_mb={memory_mb}"] if memory_mb is not None else []),
            *self.offloads.overrides(),
        ]
        return " ".join(parts)


def _rollout_parts(s: StageBytes, engine: EngineOnGPU, off: Offloads) -> tuple[tuple[str, int], ...]:
    return (
        ("trainer base", 0 if off.base else s.base),
        ("trainer lora", s.lora),
        ("trainer optimizer", 0 if off.optimizer else s.optimizer),
        ("engine weights", engine.shard.weights),
        ("engine adapters", engine.shard.adapters),
        ("engine pools", engine.pools),
        ("engine graphs", engine.graphs),
    )


def _training_parts(s: StageBytes, engine: EngineOnGPU, off: Offloads) -> tuple[tuple[str, int], ...]:
    return (
        ("trainer base", s.base),
        ("trainer lora", s.lora),
        ("trainer grads", s.lora_grads),
        ("trainer optimizer", s.optimizer),
        ("trainer activations", s.activations * s.in_flight + s.recompute_peak),
        ("engine weights", 0 if off.engine else engine.shard.weights),
        ("engine adapters", engine.shard.adapters),
    )


def loop_plan(
    layout: Layout, stages: list[StageBytes], engine: EngineOnGPU, offloads: Offloads, recompute: bool
) -> LoopPlan:
    """Both phases of `layout` (its `stages`, as `LayoutPlanner.stages` counts them at the run's micro-batch
    tokens and `recompute`) colocated with `engine`, under `offloads`; see the module docstring."""
    if not stages:
        raise ValueError("loop_plan: no trainer stages")

    def fullest(parts_of) -> Phase:
        return max((Phase(s.stage, parts_of(s, engine, offloads)) for s in stages), key=lambda p: p.total)

    moved = max(
        (s.optimizer if offloads.optimizer else 0)
        + (s.base if offloads.base else 0)
        + (engine.shard.weights if offloads.engine else 0)
        for s in stages
    )
    return LoopPlan(layout, engine, offloads, recompute, fullest(_rollout_parts), fullest(_training_parts), moved)


def best(plans: Iterable[LoopPlan], limit: float) -> LoopPlan | None:
    """The best plan that fits `limit` bytes per GPU (`LoopPlan.rank_key`), or None when none does."""
    return min((p for p in plans if p.fits(limit)), key=LoopPlan.rank_key, default=None)
