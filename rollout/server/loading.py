"""From a ServeConfig to a serving engine: the model, its tokenizer, the adapters, the engine.

The model is resolved as the trainer resolves `model.path` (`miles_k3.trainer.config.builtin_path`, the
trainer's `ModelCfg` checks, `miles_k3.trainer.base.load_base` to read and validate the checkpoint), so
`--model builtin:k3-tiny-arith` serves exactly the base a default training run starts from. A PEFT adapter
directory is read by `megatron_patches.peft_io.load_peft` (the format the trainer saves); every adapter
must share one rank and module set (the engine's adapter pool holds one shape) and keeps its own alpha.

A vision-language checkpoint (a `vision_config` in its config.json) also brings its tower and projector
(`K3VisionModel.from_pretrained`, in the engine's dtype and on its device: the engine encodes each image
once per content, `rollout.media`) and its image processor (`preprocessor_config.json`, which the server
resizes uploads by); a text-only checkpoint, or a preset (no files to read them from), takes neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_k3.model.config import K3Config
from miles_k3.model.lora_spec import LoraSpec, adaptable_modules
from miles_k3.trainer.base import TORCH_DTYPES, load_base, load_base_config
from miles_k3.trainer.config import ModelCfg
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.model_runner import build_engine_model
from rollout.server.config import ServeConfig
from rollout.server.tokenization import ServerTokenizer, build_server_tokenizer

if TYPE_CHECKING:
    from miles_k3.data.image_processor import ImageProcessor


@dataclass
class Served:
    """What the server serves: the engine, its tokenizer, and the names the APIs select it by."""

    engine: Engine
    tokenizer: ServerTokenizer
    model_name: str  # the base
    adapters: tuple[str, ...]  # loaded adapter names (each also a model name)
    model_path: str
    # the checkpoint's image processor (its preprocessor_config.json); None: a text-only model
    image_processor: ImageProcessor | None = None


def read_adapters(adapters: tuple[tuple[str, str], ...]) -> tuple[LoraSpec | None, dict[str, dict], dict[str, float]]:
    """(the pool's LoraSpec, tensors by name, alpha by name). ValueError names the adapter's flag."""
    if not adapters:
        return None, {}, {}
    # imported here: the megatron_patches package imports megatron-core (seconds), which a base-only server
    # never needs
    from megatron_patches.peft_io import load_peft

    spec, tensors, alphas = None, {}, {}
    for name, path in adapters:
        try:
            t, s = load_peft(path)
        except ValueError as e:
            raise ValueError(f"--adapter {name}={path}: {e}") from None
        if spec is None:
            spec = s
        elif (s.rank, s.targets) != (spec.rank, spec.targets):
            raise ValueError(f"--adapter {name}={path}: rank {s.rank} over {len(s.targets)} modules differs from "
                             f"the first adapter's (rank {spec.rank}, {len(spec.targets)} modules); "
                             "one server's adapters share one rank and module set")
        tensors[name], alphas[name] = t, s.alpha
    return spec, tensors, alphas


def load_vision(model: ModelCfg, config: K3Config, dtype: torch.dtype, device: str
                ) -> tuple[torch.nn.Module | None, ImageProcessor | None]:
    """(the tower + projector in eval mode, the image processor) of a vision-language checkpoint; (None,
    None) for a text-only one or a preset. ValueError naming the checkpoint part that is missing."""
    if model.path is None or config.vision_config is None:
        return None, None
    from miles_k3.data.image_processor import ImageProcessor
    from miles_k3.model.vision import K3VisionModel

    processor = ImageProcessor.from_pretrained(model.path)  # a missing preprocessor config fails before the tower
    return K3VisionModel.from_pretrained(model.path, dtype=dtype, device=device).eval(), processor


def build_engine(model: ModelCfg, cfg: ServeConfig, seed: int = 0, vision: torch.nn.Module | None = None,
                 **engine_fields) -> tuple[Engine, K3Config]:
    """The engine over `model` (a checkpoint or a random-init preset) with `cfg`'s adapters and settings;
    `vision`: the model that encodes its requests' images (`load_vision`; None: requests bring features);
    `engine_fields`: further EngineConfig fields (`speculation`, for `miles-k3 generate`)."""
    model.check()
    config, state = load_base(model, seed)
    spec, tensors, alphas = read_adapters(cfg.adapters)
    if spec is not None:
        spec.check_matches(adaptable_modules(config))
    dtype = TORCH_DTYPES[cfg.resolved_dtype]
    engine_config = EngineConfig(memory_bytes=int(cfg.memory_mb * (1 << 20)), **cfg.engine_overrides(), **engine_fields)
    em, pool = build_engine_model(config, state, quantize=cfg.quantize, lora=spec,
                                  max_adapters=max(len(tensors), 1), dtype=dtype, device=cfg.device)
    engine = Engine(em, engine_config, pool, vision=vision)
    for name, t in tensors.items():
        try:
            engine.add_adapter(name, {k: v.to(device=pool.device, dtype=pool.dtype) for k, v in t.items()},
                               alpha=alphas[name])
        except ValueError as e:
            raise ValueError(f"--adapter {name}: does not fit this model: {e}") from None
    return engine, config


def load_served(cfg: ServeConfig) -> Served:
    """Check `cfg`, then build everything it names. ValueError (one line, naming the flag) on bad input."""
    cfg.check()
    model = ModelCfg(path=str(cfg.model_path), tokenizer=cfg.tokenizer_kind)
    return build_served(model, cfg, cfg.model_name)


def build_served(model: ModelCfg, cfg: ServeConfig, name: str, seed: int = 0) -> Served:
    """`model` (a checkpoint, or a random-init preset: what benchmarks serve) with `cfg`'s engine settings
    and adapters, its tokenizer loaded first (it fails faster than the weights), then its vision side
    (`load_vision`)."""
    where = model.path if model.path is not None else f"preset:{model.preset}"
    tokenizer = build_server_tokenizer(model.tokenizer, where)
    model.check()
    vision, processor = load_vision(model, load_base_config(model), TORCH_DTYPES[cfg.resolved_dtype], cfg.device)
    engine, config = build_engine(model, cfg, seed, vision=vision)
    if not 0 <= tokenizer.eos_token_id < config.vocab_size:
        raise ValueError(f"--tokenizer: eos id {tokenizer.eos_token_id} is outside the model's vocabulary "
                         f"({config.vocab_size}); is it the model's tokenizer?")
    return Served(engine, tokenizer, name, tuple(n for n, _ in cfg.adapters), where, processor)
