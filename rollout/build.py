"""One engine from one spec: `EngineSpec` says what to build, `build_engine` builds it. Every front door builds
its engine here: `miles-serve` (`rollout.server.loading`), `miles-k3 generate` (one process, or each of its
--tp ranks), the trainer's rollout worker (with the base it has already loaded) and
`build_sharded_engine` (a TP group's rank from a checkpoint or a state dict).

    spec = EngineSpec(path="builtin:k3-tiny-arith", adapters=(("policy", "runs/grpo/adapter"),),
                      engine=EngineConfig(memory_bytes=64 << 20))
    engine = build_engine(spec)                                         # one process
    engine = build_engine(replace(spec, tp=2, device=f"cuda:{rank}"))   # on every rank of a 2-process world
    engine = build_engine(EngineSpec(lora=lora, max_adapters=1, engine=config), base=(k3_config, state))

The base comes from the spec (a checkpoint directory, or a random-init preset initialized from `seed`, read
by `miles_k3.model.base.load_base`: the same weights the trainer starts from) or, already in memory, from the
caller (`base=`). PEFT adapters named by the spec are read (`miles_k3.model.peft.load_peft`, the format
the trainer saves) and loaded under their names; they share one rank and module set (the pool holds one
shape) and each keeps its own alpha.

Errors are one-line ValueErrors naming the spec's field ("EngineSpec.quantize must be one of ..."), so a
front door can rename them to its own flags or keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles_k3.model.assets import builtin_path
from miles_k3.model.base import DTYPES, SPECIAL_TOKENS, TORCH_DTYPES, load_base, load_base_config
from miles_k3.model.config import PRESETS, K3Config
from miles_k3.model.linear import SINGLE
from miles_k3.model.lora_spec import LoraSpec, adaptable_modules
from miles_k3.model.peft import load_peft
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.model_runner import QUANTIZE_MODES, build_engine_model

if TYPE_CHECKING:
    from miles_k3.model.checkpoint import TensorSource


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What `build_engine` builds, checked on construction (ValueError "EngineSpec.<field> ...").

    The base is `path` or `preset` (not both); neither: the caller hands `build_engine` a loaded base. Layout:
    `tp` processes (one engine rank each), `ep` 1 (routed experts split by their intermediate dim) or `tp`
    (whole experts, num_experts / tp per rank), `dcp` ranks per decode-context-parallel group (divides tp;
    `engine.dcp_size` is set to it)."""

    # the base: an HF checkpoint directory (config.json + safetensors) or builtin:<name> (stored resolved)
    path: str | None = None
    preset: str | None = None  # or a random-init K3Config preset (benchmarks), initialized from `seed`
    vocab_size: int | None = None  # with preset: its vocabulary size
    # with preset: pad / bos / eos ids of the tokenizer it runs with (`miles_k3.data.tokenizers.preset_token_ids`)
    token_ids: Mapping[str, int] | None = None
    seed: int = 0  # with preset: the initialization seed (the trainer's trainer.seed gives its weights)
    quantize: str = "experts"  # QUANTIZE_MODES: the base as stored, MXFP4 routed experts, or every projection
    dtype: str | None = None  # DTYPES (a torch dtype is taken by name); None: bfloat16 on cuda, float32 on cpu
    device: str = "cpu"  # this process's device (a sharded engine's rank r: "cuda:r", its own GPU)
    lora: LoraSpec | None = None  # the adapter pool's shape; None: the adapters' own (no adapters: no pool)
    adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT directory): loaded at build, under name
    max_adapters: int | None = None  # adapter slots; None: one per adapter (at least 1)
    tp: int = 1
    ep: int = 1
    dcp: int = 1
    engine: EngineConfig  # scheduling, memory, speculation

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"EngineSpec.{name} {rule}, got {getattr(self, name)!r}")

        def int_at_least(name: str, low: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise fail(name, f"must be an integer >= {low}")

        def put(name: str, value: Any) -> None:  # frozen: each field is normalized once, here
            object.__setattr__(self, name, value)

        if self.path is not None and self.preset is not None:
            raise ValueError(
                f"EngineSpec.path or EngineSpec.preset, not both (a checkpoint, or a random-init "
                f"preset), got path={self.path!r}, preset={self.preset!r}"
            )
        if self.path is not None:
            path = builtin_path(str(self.path)) if isinstance(self.path, (str, Path)) else None
            if path is None or not (Path(path) / "config.json").is_file():
                raise fail("path", "must be a directory holding config.json (an HF checkpoint) or builtin:<name>")
            put("path", path)
        if self.preset is not None and self.preset not in PRESETS:
            raise fail("preset", f"must be one of {sorted(PRESETS)}")
        for name in ("vocab_size", "token_ids"):
            if getattr(self, name) is not None and self.preset is None:
                raise fail(name, "only applies with EngineSpec.preset (a checkpoint fixes its vocabulary)")
        if self.vocab_size is not None:
            int_at_least("vocab_size", 2)
        if self.token_ids is not None:
            if not isinstance(self.token_ids, Mapping) or not set(self.token_ids) <= set(SPECIAL_TOKENS):
                raise fail("token_ids", f"must map some of {SPECIAL_TOKENS} to ids")
            put("token_ids", dict(self.token_ids))
        int_at_least("seed", 0)
        if self.quantize not in QUANTIZE_MODES:
            raise fail("quantize", f"must be one of {QUANTIZE_MODES}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise fail("device", "must be a cpu or cuda device (cpu, cuda, cuda:<index>)")
        put("device", str(device))
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            dtype = next((name for name, t in TORCH_DTYPES.items() if t == dtype), dtype)
        if dtype is None:
            dtype = "bfloat16" if device.type == "cuda" else "float32"
        if dtype not in DTYPES:
            raise fail("dtype", f"must be one of {DTYPES}")
        put("dtype", dtype)
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise fail("lora", "must be a LoraSpec or None")
        adapters = tuple(tuple(a) for a in self.adapters) if isinstance(self.adapters, (tuple, list)) else None
        if adapters is None or not all(
            len(a) == 2 and isinstance(a[0], str) and a[0] and "=" not in a[0] and isinstance(a[1], (str, Path))
            for a in adapters
        ):
            raise fail("adapters", "must be (name, PEFT directory) pairs, each name non-empty and without '='")
        if len({name for name, _ in adapters}) != len(adapters):
            raise fail("adapters", "names must be distinct")
        put("adapters", tuple((name, str(path)) for name, path in adapters))
        if self.max_adapters is None:
            put("max_adapters", max(len(adapters), 1))
        int_at_least("max_adapters", max(len(adapters), 1))
        int_at_least("tp", 1)
        if self.ep not in (1, self.tp) or isinstance(self.ep, bool):
            raise fail(
                "ep", f"must be 1 or EngineSpec.tp ({self.tp}): expert parallelism runs over the tensor-parallel ranks"
            )
        int_at_least("dcp", 1)
        if self.tp % self.dcp:
            raise fail(
                "dcp",
                f"must divide EngineSpec.tp ({self.tp}): decode context parallelism runs inside the "
                "tensor-parallel group",
            )
        if not isinstance(self.engine, EngineConfig):
            raise fail("engine", "must be an EngineConfig")
        if self.engine.dcp_size not in (1, self.dcp):
            raise ValueError(
                f"EngineSpec.engine.dcp_size={self.engine.dcp_size} differs from EngineSpec.dcp="
                f"{self.dcp}: the layout sets it"
            )
        put("engine", dataclasses.replace(self.engine, dcp_size=self.dcp))

    @property
    def has_base(self) -> bool:
        """Whether the spec names its base (path or preset): else `build_engine` needs `base=`."""
        return self.path is not None or self.preset is not None

    def base_config(self) -> K3Config:
        """The base's config alone (`miles_k3.model.base.load_base_config`: config.json, or the preset's)."""
        if not self.has_base:
            raise ValueError("EngineSpec names no base (path or preset): the caller holds it")
        return load_base_config(self.path, preset=self.preset, vocab_size=self.vocab_size, token_ids=self.token_ids)

    def check_layout(self, config: K3Config) -> None:
        """That `config` splits over this spec's tp / ep layout (`rollout.model_runner.check_layout`: heads,
        vocabulary, expert dims); ValueError "EngineSpec.tp=N: ..." naming the field. For the caller's own
        process, before any rank is spawned (each rank would otherwise meet it alone)."""
        if self.tp == 1:
            return
        from miles_k3.model.linear import TensorParallel
        from rollout.model_runner import check_layout

        tp = TensorParallel(self.tp)
        tp.ep_size = self.ep
        try:
            check_layout(config, tp)
        except ValueError as e:
            raise ValueError(f"EngineSpec.tp={self.tp}: {e}") from None

    def load_base(self) -> tuple[K3Config, Mapping[str, torch.Tensor] | TensorSource]:
        """(config, tensors) of the base: a preset initialized from `seed`; a checkpoint read whole in one
        process, or as a lazy `CheckpointSource` when sharded (each rank reads only its slices)."""
        if not self.has_base:
            raise ValueError("EngineSpec names no base (path or preset): the caller holds it")
        return load_base(
            self.path,
            preset=self.preset,
            vocab_size=self.vocab_size,
            token_ids=self.token_ids,
            seed=self.seed,
            whole=self.tp == 1,
        )


def read_adapters(spec: EngineSpec) -> tuple[LoraSpec | None, dict[str, dict[str, torch.Tensor]], dict[str, float]]:
    """(the pool's LoraSpec, tensors by name, alpha by name) of `spec.adapters`: every adapter of one rank and
    module set, and `spec.lora`'s when that is given. Any format `load_peft` reads (ours, transformers-native
    Kimi-Linear, K3's published names, stacked experts), checked against the spec's base config when the spec
    names one. ValueError "EngineSpec.adapters NAME=DIR: <file>: module ...: ..." (the CLIs show --adapter)."""
    lora, tensors, alphas = spec.lora, {}, {}
    if not spec.adapters:
        return lora, tensors, alphas
    first = "EngineSpec.lora's" if lora is not None else None
    # with the spec's base at hand, every module of an adapter must be one of its modules, with its shapes
    config = spec.base_config() if spec.has_base else None
    for name, path in spec.adapters:
        where = f"EngineSpec.adapters {name}={path}"
        try:
            t, s = load_peft(path, config=config)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if lora is None:
            lora, first = s, "the first adapter's"
        elif (s.rank, s.targets) != (lora.rank, lora.targets):
            raise ValueError(
                f"{where}: rank {s.rank} over {len(s.targets)} modules differs from {first} (rank "
                f"{lora.rank}, {len(lora.targets)} modules); one engine's adapters share one rank "
                "and module set"
            )
        tensors[name], alphas[name] = t, s.alpha
    return lora, tensors, alphas


def build_engine(
    spec: EngineSpec,
    *,
    base: tuple[K3Config, Mapping[str, torch.Tensor] | TensorSource] | None = None,
    group: Any = None,
    parallel: Any = None,
    vision: torch.nn.Module | None = None,
) -> Engine:
    """The engine `spec` describes, with its adapters loaded.

    base: (config, tensors) already loaded (the trainer's fp32 base: a logical HF state dict, or any
    `TensorSource`), used instead of reading the spec's base (whose config, when the spec names one, must be
    `config`); None: the spec's (`EngineSpec.load_base`).
    vision: the model that encodes requests' images (`K3VisionModel`; None: requests bring features).

    With `spec.tp > 1` call it on every rank of `group` (default: the whole torch.distributed world, which must hold
    `spec.tp` processes), with the same spec but for `device`, after `init_process_group` (gloo on CPU, nccl with
    one GPU per rank: set the device first); or hand this rank's `parallel` (`rollout.parallel.EngineTP`, e.g. of
    `replica_groups`: one of several engines in one world) instead. Rank 0 gets the engine's caller (it loads the
    adapters, whose tensors reach every rank); every other rank must then call `engine.follow()`, which replays rank
    0's calls until rank 0 calls `engine.stop_followers()` (`rollout.parallel`)."""
    lora, tensors, alphas = read_adapters(spec)
    if base is None:
        config, state = spec.load_base()
    else:
        config, state = base
        if spec.has_base and spec.base_config() != config:
            raise ValueError("EngineSpec: the base handed to build_engine is not the spec's (their configs differ)")
    if lora is not None:
        try:
            lora.check_matches(adaptable_modules(config))
        except ValueError as e:
            raise ValueError(f"EngineSpec.{'adapters' if spec.adapters else 'lora'}: {e}") from None
    tp = SINGLE
    if spec.tp > 1:
        import torch.distributed as dist

        from rollout.parallel import EngineTP

        if parallel is not None:
            size, layout = parallel.size, (parallel.ep_size, parallel.dcp_size)
            if layout != (spec.ep, spec.dcp):
                raise ValueError(f"EngineSpec ep / dcp {(spec.ep, spec.dcp)} differ from `parallel`'s {layout}")
        else:
            size = dist.get_world_size(group) if dist.is_initialized() else 1
        if size != spec.tp:
            raise ValueError(
                f"EngineSpec.tp={spec.tp}: build it on every rank of a torch.distributed group of "
                f"{spec.tp} processes (init_process_group first), got a group of {size}"
            )
        tp = parallel if parallel is not None else EngineTP(group, ep_size=spec.ep, dcp_size=spec.dcp)
    model, pool = build_engine_model(
        config,
        state,
        quantize=spec.quantize,
        lora=lora,
        max_adapters=spec.max_adapters,
        dtype=TORCH_DTYPES[spec.dtype],
        device=spec.device,
        tp=tp,
    )
    engine = Engine(model, spec.engine, pool, vision=vision)
    if engine.is_leader:
        try:
            for name, t in tensors.items():
                engine.add_adapter(
                    name, {k: v.to(device=pool.device, dtype=pool.dtype) for k, v in t.items()}, alpha=alphas[name]
                )
        except ValueError as e:
            if spec.tp > 1:
                engine.stop_followers()  # they wait in follow(): release them before failing
            raise ValueError(f"EngineSpec.adapters {name}: does not fit this model: {e}") from None
    return engine


def build_sharded_engine(
    path_or_state: str | Path | Mapping[str, torch.Tensor],
    config: "EngineConfig",
    *,
    model_config=None,
    group=None,
    ep: bool = False,
    quantize: str = "experts",
    lora=None,
    max_adapters: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> "Engine":
    """This process's rank of a TP engine over `group` (default: the whole torch.distributed world). Call it
    on every rank of the group with the same arguments, after `init_process_group` (gloo on CPU, nccl with
    one GPU per rank: set the device first).

    path_or_state: a checkpoint directory (config.json + safetensors; each rank reads only its slices through
    `miles_k3.model.checkpoint.CheckpointSource`) or a logical HF state dict with `model_config`. `ep`: whole
    routed experts, num_experts / tp per rank (else split by intermediate dim). `config.dcp_size`: the DCP
    group size. The rest as `rollout.model_runner.build_engine_model`. A thin wrapper of
    `rollout.build.build_engine` (an `EngineSpec` with tp = the group's size), which takes PEFT adapters too.

    How it runs: rank 0 is the engine's caller (`submit`, `step`, `generate`, `stream`, `abort`,
    `add_adapter` / `update_adapter` with the trainer's full tensors, `release_memory` / `resume_memory`)
    and gets the completions; when done it calls `engine.stop_followers()`. Every other rank calls
    `engine.follow()`, which replays rank 0's calls step by step and returns once rank 0 stops:

        engine = build_sharded_engine(path, EngineConfig(memory_bytes=...), device=f"cuda:{rank}")
        if engine.is_leader:
            outs = engine.generate(prompts, SamplingParams(temperature=0))
            engine.stop_followers()
        else:
            engine.follow()
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("build_sharded_engine needs torch.distributed initialized (init_process_group) on every rank")
    base = None
    if not isinstance(path_or_state, (str, Path)):
        if model_config is None:
            raise ValueError("build_sharded_engine: a state dict needs model_config (its K3Config)")
        base = (model_config, path_or_state)
    size = dist.get_world_size(group)
    spec = EngineSpec(
        path=None if base is not None else str(path_or_state),
        quantize=quantize,
        dtype=dtype,
        device=str(device),
        lora=lora,
        max_adapters=max_adapters,
        tp=size,
        ep=size if ep else 1,
        dcp=config.dcp_size,
        engine=config,
    )
    return build_engine(spec, base=base, group=group)
