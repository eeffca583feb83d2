"""The frozen base a run starts from, from a checkpoint directory or a random-init preset: its config alone
(`load_base_config`) or with its tensors (`load_base`). The trainer and the engine read the same base this
way (one K3 definition, one set of weights): `miles-train` with model.*'s fields, `miles-serve` and
`miles-k3 generate` through `rollout.build.EngineSpec`.

    config = load_base_config("/ckpt")                                    # config.json
    config, state = load_base("/ckpt")                                    # + every tensor, fp32
    config, state = load_base(preset="k3-small", vocab_size=32, seed=0)   # initialized, as stored
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from miles_k3.model.checkpoint import CheckpointSource, as_stored, load_state_dict
from miles_k3.model.config import K3Config
from miles_k3.model.modeling import reference_state

DTYPES = ("float32", "bfloat16")  # the dtypes a base, an engine or a trainer runs in, by name
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # DTYPES' torch dtypes
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id")  # the K3Config fields `token_ids` may set


def load_base_config(
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    vocab_size: int | None = None,
    token_ids: Mapping[str, int] | None = None,
) -> K3Config:
    """The base's config alone (what a driver that holds no weights needs): `path`'s config.json, or the
    preset's config with `vocab_size` and `token_ids` (special-token ids, `SPECIAL_TOKENS`: the vocabulary the
    preset is run with, e.g. `miles_k3.data.tokenizers.preset_token_ids`) set. Exactly one of path and
    preset; a checkpoint fixes its vocabulary, so vocab_size and token_ids apply to a preset only. One-line
    ValueError naming the argument."""
    if (path is None) == (preset is None):
        raise ValueError(
            f"the base is a checkpoint path or a preset (exactly one), got path={path!r}, preset={preset!r}"
        )
    overrides = dict(token_ids or {})
    unknown = sorted(set(overrides) - set(SPECIAL_TOKENS))
    if unknown:
        raise ValueError(f"token_ids may set {SPECIAL_TOKENS}, got {unknown}")
    if path is not None:
        if vocab_size is not None or overrides:
            raise ValueError("vocab_size and token_ids apply to a preset only (a checkpoint fixes its vocabulary)")
        return K3Config.from_json_file(Path(path) / "config.json")
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return K3Config.from_preset(preset, **overrides)


def load_base(
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    vocab_size: int | None = None,
    token_ids: Mapping[str, int] | None = None,
    seed: int = 0,
    whole: bool = True,
):
    """(config, the base's tensors); the arguments but `seed` and `whole` as `load_base_config`. A preset is
    initialized with `seed` (same weights on every rank and on both the trainer and the engine) and stored as
    its checkpoint would be (MXFP4-grid routed experts where the preset ships them), as a logical HF state
    dict in fp32. A path is validated by the checkpoint loader and, with `whole`, read into such a dict (the
    engine needs every tensor); without it, returned as a lazy `CheckpointSource` from which a trainer rank
    reads only its own slices."""
    config = load_base_config(path, preset=preset, vocab_size=vocab_size, token_ids=token_ids)
    if path is not None:
        if not whole:
            return config, CheckpointSource(path, config, torch.float32)
        return config, load_state_dict(path, config, torch.float32)
    return config, as_stored(reference_state(config, seed), config)
