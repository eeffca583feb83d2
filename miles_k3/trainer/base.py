"""The frozen base both sides start from (one K3 definition, one set of weights) and the run's tokenizer, as
model.* names them: the trainer's calls of the model layer's loading (`miles_k3.model.base`) and the data
layer's tokenizers (`miles_k3.data.tokenizers`) with `ModelCfg`'s fields."""

from __future__ import annotations

import logging
import warnings

from miles_k3.data.tokenizers import Tokenizer, load_tokenizer, preset_token_ids
from miles_k3.model import base as model_base
from miles_k3.model.config import K3Config
from miles_k3.trainer.config import ModelCfg


def quiet_megatron() -> None:
    """megatron-core announces, on import, every optional CUDA library it falls back from; on a CPU laptop
    that is a screen of noise before the progress bar, and says nothing about this run. Per process (a
    spawned rank starts with fresh warning filters)."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    logging.getLogger("megatron").setLevel(logging.WARNING)


def base_args(model: ModelCfg) -> dict:
    """`miles_k3.model.base.load_base_config`'s arguments for model.*: the checkpoint, or the preset with its
    vocabulary and the special ids of model.tokenizer (`miles_k3.data.tokenizers.preset_token_ids`)."""
    if model.path is not None:
        return {"path": model.path}
    return {"preset": model.preset, "vocab_size": model.vocab_size, "token_ids": preset_token_ids(model.tokenizer)}


def load_base(model: ModelCfg, seed: int, whole: bool = True):
    """(config, the base's tensors) of model.* (`miles_k3.model.base.load_base`: a preset initialized with
    `seed`; a checkpoint read whole, or with `whole=False` as a lazy `CheckpointSource`)."""
    return model_base.load_base(**base_args(model), seed=seed, whole=whole)


def load_base_config(model: ModelCfg) -> K3Config:
    """The model's config alone (what a driver that holds no weights needs)."""
    return model_base.load_base_config(**base_args(model))


def build_tokenizer(model: ModelCfg, config: K3Config) -> Tokenizer:
    """The run's tokenizer, its eos checked against the model's vocabulary."""
    tok = load_tokenizer(model.tokenizer, model.path)
    if tok.eos_token_id >= config.vocab_size:
        raise ValueError(f"eos id {tok.eos_token_id} is outside the model's vocabulary ({config.vocab_size})")
    return tok
