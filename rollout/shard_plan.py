"""What one engine shard holds on its GPU, for a layout that has not been started: `miles-k3 plan`'s engine side.

    layout = EngineLayout.parse("tp=16,dcp=1,ep=1")          # rollout.tp / rollout.dcp / rollout.ep
    shard = engine_shard_bytes(config, layout, quantize="all", lora=LoraSpec(rank=16))
    shard.weights, shard.routed_experts, shard.adapters      # bytes of one shard (every shard holds as much)

No formula to drift: the shard is the engine's own module tree, `rollout.model_runner.EngineFactory` and
`K3ForCausalLM` on the meta device, as `build_engine_model` builds it before loading (the adapter pool on the
meta device too), with `build_engine_model`'s casts applied; its bytes are read off that tree. MXFP4
(`quantize` "experts" / "all") is what the factory allocates: a uint8 byte of two 4-bit values and one e8m0
scale byte per 32 values (4.25 bits an element), only where the local input width is a multiple of 32 (else
the projection stays in `dtype`; the lm_head always does). A test holds the count to a real shard built on CPU.

A layout's rank is built without a process group (`_ShapeTP`: `EngineTP`'s shares, no collectives): every rank
of a layout holds the same shapes (the splits are even, `check_layout` refuses the rest), so rank 0 stands for
all. What is left out: the KV / state pools (`rollout.memory.PoolSizes`; the planner adds them), CUDA graphs,
and the stacked views `share_input_gemms` makes (they alias the weights: no bytes of their own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_k3.model.config import K3Config
from miles_k3.model.linear import SINGLE, TensorParallel
from miles_k3.model.lora_spec import LoraSpec
from rollout.parallel import EngineTP


@dataclass(frozen=True)
class EngineLayout:
    """The engine's own layout (the `rollout.*` keys; `miles-k3 generate --tp/--dcp/--ep`): `tp` ranks per
    engine replica, `dcp` ranks per decode-context-parallel group (divides tp and the KV page size), `ep` whole
    routed experts split over the tp ranks (num_experts / tp each) instead of each expert's intermediate dim.
    Checked on construction by the engine's own spec (`rollout.build.EngineSpec`): ValueError."""

    tp: int = 1
    dcp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        from rollout.build import EngineSpec
        from rollout.config import EngineConfig

        if not isinstance(self.ep, bool):
            raise ValueError(f"EngineLayout.ep must be a bool, got {self.ep!r}")
        if self.ep and self.tp == 1:
            raise ValueError("EngineLayout.ep needs tp > 1: expert parallelism runs over the tensor-parallel ranks")
        # EngineSpec checks tp, ep and dcp, then EngineConfig (its engine.dcp_size set to dcp) the page size
        EngineSpec(tp=self.tp, ep=self.tp if self.ep else 1, dcp=self.dcp, engine=EngineConfig(memory_bytes=1))

    def __str__(self) -> str:
        return f"tp={self.tp},dcp={self.dcp},ep={int(self.ep)}"

    @classmethod
    def parse(cls, text: str) -> "EngineLayout":
        """ "tp=16,dcp=1,ep=1" (dcp default 1, ep 0/1 or false/true, default 0); ValueError names --engine-layout."""
        sizes: dict[str, int | bool] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            value = value.strip().lower()
            if not sep or key not in ("tp", "dcp", "ep") or key in sizes:
                raise ValueError(f"--engine-layout {text!r}: expected comma-separated tp=, dcp=, ep= (each once)")
            if key == "ep":
                if value not in ("0", "1", "false", "true"):
                    raise ValueError(f"--engine-layout {text!r}: ep must be 0, 1, false or true, got {value!r}")
                sizes[key] = value in ("1", "true")
            elif not value.isdigit() or int(value) < 1:
                raise ValueError(f"--engine-layout {text!r}: {key} must be an integer >= 1, got {value!r}")
            else:
                sizes[key] = int(value)
        if "tp" not in sizes:
            raise ValueError(f"--engine-layout {text!r}: tp= is required")
        try:
            return cls(**sizes)
        except ValueError as e:
            raise ValueError(f"--engine-layout {text!r}: {e}") from None

    def overrides(self) -> str:
        """The recipe overrides that select this layout."""
        return f"rollout.tp={self.tp} rollout.dcp={self.dcp} rollout.ep={str(self.ep).lower()}"

    def check(self, config: K3Config) -> None:
        """ValueError naming the config field unless `config` splits over this layout (heads, vocabulary,
        expert dims: `rollout.model_runner.check_layout`)."""
        from rollout.model_runner import check_layout

        check_layout(config, _ShapeTP(self))


def engine_layouts(config: K3Config, gpus: int) -> list[EngineLayout]:
    """Candidate layouts of an engine replica on `gpus` GPUs: tp a power of two dividing `gpus` that the
    config splits over, with and without EP, dcp 1 or tp (where the page size allows)."""
    out = []
    tp = 1
    while tp <= gpus and gpus % tp == 0:
        for ep in (False, True) if tp > 1 else (False,):
            for dcp in sorted({1, tp}):
                try:
                    layout = EngineLayout(tp, dcp, ep)
                    layout.check(config)
                except ValueError:
                    continue
                out.append(layout)
        tp *= 2
    return out


class _ShapeTP(EngineTP):
    """Rank `rank`'s shares of an `EngineLayout` without a process group: what a sharded build allocates, for
    meta builds (its collectives must not run)."""

    def __init__(self, layout: EngineLayout, rank: int = 0):
        TensorParallel.__init__(self, layout.tp, rank)
        self.ep_size, self.dcp_size, self.dcp_rank = (layout.tp if layout.ep else 1), layout.dcp, rank % layout.dcp
        self.group = self.control = self.dcp_group = None
        self.channel_rank = 0


@dataclass(frozen=True)
class EngineShardBytes:
    """The bytes one engine shard keeps on its device besides its pools: `weights` the base (MXFP4 packed
    bytes and scales, the rest in the engine's dtype, router / decay tensors in fp32), of which
    `routed_experts` the routed experts; `adapters` the adapter pool (its slots of this shard's LoRA A / B)."""

    weights: int
    routed_experts: int
    adapters: int

    @property
    def total(self) -> int:
        return self.weights + self.adapters


def model_bytes(model: torch.nn.Module, pool=None) -> EngineShardBytes:
    """The bytes of a built engine model (meta or real) and its adapter pool (`rollout.lora.AdapterPool` or
    None): every parameter and buffer once, at its own dtype."""
    seen: set[int] = set()
    weights = experts = 0
    for prefix, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for t in store.values():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                n = t.numel() * t.element_size()
                weights += n
                if prefix.endswith(".experts"):
                    experts += n
    adapters = 0 if pool is None else sum(t.numel() * t.element_size() for d in (pool.A, pool.B) for t in d.values())
    return EngineShardBytes(weights, experts, adapters)


def engine_shard_bytes(
    config: K3Config,
    layout: EngineLayout,
    *,
    quantize: str = "all",
    lora: LoraSpec | None = None,
    max_adapters: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> EngineShardBytes:
    """One shard of `layout` as `build_engine_model(config, ..., quantize=, lora=, max_adapters=, dtype=)` holds
    it (the RL loop's engine: `max_adapters=1`), counted off the module tree built on the meta device.
    ValueError when the config does not split over the layout or `quantize` is not a mode."""
    model, pool = meta_shard(config, layout, quantize=quantize, lora=lora, max_adapters=max_adapters, dtype=dtype)
    return model_bytes(model, pool)


def meta_shard(
    config: K3Config,
    layout: EngineLayout,
    rank: int = 0,
    *,
    quantize: str = "all",
    lora: LoraSpec | None = None,
    max_adapters: int = 1,
    dtype: torch.dtype = torch.bfloat16,
):
    """(model, adapter pool or None) of engine rank `rank` of `layout`, built on the meta device as
    `build_engine_model` builds it (its casts applied): its bytes, and its pool's `local_boxes` (the blocks of
    the adapter a shard-to-shard sync delivers to that rank)."""
    from rollout.model_runner import QUANTIZE_MODES, _cast_floating, engine_skeleton

    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    tp = _ShapeTP(layout, rank) if layout.tp > 1 else SINGLE
    model, pool, _ = engine_skeleton(config, tp, quantize, lora, max_adapters, dtype, "meta")
    _cast_floating(model, dtype)  # as build_engine_model leaves it after loading
    return model, pool
