"""From a ServeConfig to a serving engine: the tokenizer, the tower and its image processor, the engine.

The engine is `rollout.build.build_engine` of the flags' `EngineSpec` (`ServeConfig.engine_spec`): the base
is read as the trainer reads model.path (`miles_k3.model.base.load_base`, `builtin:` paths resolved by
`miles_k3.model.assets`), so `--model builtin:k3-tiny-arith` serves exactly the base a default training run
starts from, and the PEFT adapters (the format the trainer saves) load under their names: at build, in a
pool of their own shape, or, with --max-lora-rank, into the pool the flags shape, through `load_adapter`,
the loader /load_lora_adapter uses too.

A vision-language checkpoint (a `vision_config` in its config.json) also brings its tower and projector
(`K3VisionModel.from_pretrained`, in the engine's dtype and on its device: the engine encodes each image
once per content, `rollout.media`) and its image processor (`preprocessor_config.json`, which the server
resizes uploads by); a text-only checkpoint, or a preset (no files to read them from), takes neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from miles_k3.model.base import TORCH_DTYPES
from miles_k3.model.config import K3Config
from rollout.build import EngineSpec, build_engine
from rollout.engine import Engine
from rollout.server.config import ServeConfig, flag_errors
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


def load_vision(
    path: str | None, config: K3Config, dtype: torch.dtype, device: str
) -> tuple[torch.nn.Module | None, ImageProcessor | None]:
    """(the tower + projector in eval mode, the image processor) of the vision-language checkpoint at `path`;
    (None, None) for a text-only one or a preset (`path` None). ValueError naming the checkpoint part that is
    missing."""
    if path is None or config.vision_config is None:
        return None, None
    from miles_k3.data.image_processor import ImageProcessor
    from miles_k3.model.vision import K3VisionModel

    processor = ImageProcessor.from_pretrained(path)  # a missing preprocessor config fails before the tower
    return K3VisionModel.from_pretrained(path, dtype=dtype, device=device).eval(), processor


def load_served(cfg: ServeConfig, device: str | None = None) -> Served:
    """Check `cfg`, then build everything it names. ValueError (one line, naming the flag) on bad input.
    With --max-lora-rank the engine is built with the flags' empty pool and the --adapter ones are loaded
    into it after (`load_adapter`), as /load_lora_adapter would. `device`: a sharded engine rank's (rank 0 of
    `miles-serve --tp`)."""
    cfg.check()
    spec = cfg.engine_spec() if device is None else cfg.engine_spec(device=device)  # a sharded rank's own device
    served = build_served(spec, cfg.tokenizer_kind, cfg.model_name)
    if cfg.max_lora_rank is not None:
        for name, path in cfg.adapters:
            try:
                load_adapter(served.engine, name, Path(path))
            except ValueError as e:
                raise ValueError(f"--adapter {name}={path}: {e}") from None
        served.adapters = tuple(name for name, _ in cfg.adapters)
    return served


def load_adapter(engine: Engine, name: str, path: Path) -> None:
    """Read the PEFT adapter directory `path` (any layout `miles_k3.model.peft.load_peft` reads, checked against
    the served model) and load it as `name` into a free slot of `engine`'s adapter pool; on the engine's
    thread. The pool's shape bounds what it takes: an adapter of a lower rank r is zero-padded into the slot
    (the same delta B A x at the same scale alpha / r), a pool module it does not adapt gets a zero delta. No
    pool, a higher rank, a module outside the pool or no free slot is a ValueError naming the flag that sets
    the bound (--max-lora-rank, --lora-target-modules, --max-loras); nothing is loaded then."""
    from miles_k3.model.peft import load_peft

    pool = engine.adapters
    if pool is None:
        raise ValueError(
            "this server has no adapter pool: start it with --max-lora-rank R (and --max-loras N) to load "
            "adapters at runtime"
        )
    if len(pool.names) >= pool.max_adapters:
        raise ValueError(
            f"all {pool.max_adapters} adapter slots are in use ({sorted(pool.names)}); unload one or start the "
            "server with more --max-loras"
        )
    tensors, spec = load_peft(path, config=engine.model.config)
    rank, modules = pool.spec.rank, set(pool.A)
    if spec.rank > rank:
        raise ValueError(f"rank {spec.rank} exceeds the adapter pool's rank {rank} (--max-lora-rank)")
    outside = sorted({key.rsplit(".", 1)[0] for key in tensors} - modules)
    if outside:
        raise ValueError(
            f"adapts {len(outside)} module(s) outside the adapter pool's {len(modules)}, e.g. {outside[:3]} "
            "(--lora-target-modules)"
        )
    full = {}
    for m in sorted(modules):
        for part, buf, dim in (("lora_A", pool.A[m], -2), ("lora_B", pool.B[m], -1)):
            key = f"{m}.{part}"
            shape = list(pool.full_shapes.get(key, buf.shape[1:]))  # the trainer's (full) shape at the pool's rank
            t = torch.zeros(shape, dtype=pool.dtype, device=pool.device)
            if key in tensors:  # the adapter's rank spec.rank fills the first rows (A) / columns (B)
                t.narrow(dim, 0, spec.rank).copy_(tensors[key])
            full[key] = t
    # the pool scales a slot by alpha / its rank: given alpha / r * R, the slot's scale is the adapter's own
    # alpha / r (exactly when R is a power of two, else within a float's rounding)
    engine.add_adapter(name, full, spec.alpha if spec.rank == rank else spec.alpha / spec.rank * rank)


def build_served(spec: EngineSpec, tokenizer: str, name: str) -> Served:
    """The engine of `spec` (a checkpoint, or a random-init preset: what benchmarks serve) served as `name`,
    with the `tokenizer` kind (`miles_k3.data.tokenizers.TOKENIZERS`) loaded first (it fails faster than the
    weights), then its vision side (`load_vision`). Errors name the flags (`flag_errors`)."""
    where = spec.path if spec.path is not None else f"preset:{spec.preset}"
    tok = build_server_tokenizer(tokenizer, spec.path, where)
    with flag_errors():
        vision, processor = load_vision(spec.path, spec.base_config(), TORCH_DTYPES[spec.dtype], spec.device)
        engine = build_engine(spec, vision=vision)
    vocab = engine.model.config.vocab_size
    if not 0 <= tok.eos_token_id < vocab:
        raise ValueError(
            f"--tokenizer: eos id {tok.eos_token_id} is outside the model's vocabulary ({vocab}); is "
            "it the model's tokenizer?"
        )
    return Served(engine, tok, name, tuple(n for n, _ in spec.adapters), where, processor)
