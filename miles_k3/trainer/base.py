"""The frozen base both sides start from (one K3 definition, one set of weights) and the run's tokenizer."""

from __future__ import annotations

import importlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_k3.model.checkpoint import CheckpointSource, as_stored, load_state_dict
from miles_k3.model.config import K3Config
from miles_k3.model.modeling import reference_state
from miles_k3.trainer.config import ModelCfg

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # config.DTYPES by name


def quiet_megatron() -> None:
    """megatron-core announces, on import, every optional CUDA library it falls back from; on a CPU laptop
    that is a screen of noise before the progress bar, and says nothing about this run. Per process (a
    spawned rank starts with fresh warning filters)."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    logging.getLogger("megatron").setLevel(logging.WARNING)


def load_base(model: ModelCfg, seed: int, whole: bool = True):
    """(config, the base's tensors). A preset is initialized with `seed` (same weights on every rank and on
    both the trainer and the engine) and stored as its checkpoint would be (MXFP4-grid routed experts where
    the preset ships them), as a logical HF state dict in fp32. A path is validated by the checkpoint loader
    and, with `whole`, read into such a dict (the engine needs every tensor); without it, returned as a lazy
    `CheckpointSource` from which a trainer rank reads only its own slices."""
    config = load_base_config(model)
    if model.path is not None:
        if not whole:
            return config, CheckpointSource(model.path, config, torch.float32)
        return config, load_state_dict(model.path, config, torch.float32)
    return config, as_stored(reference_state(config, seed), config)


class Tokenizer(Protocol):
    """The run's tokenizer, as the trainer, rollout plugins and the server (which wraps it) use it."""

    eos_token_id: int

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt string -> ids, special tokens added as training adds them."""
    def encode(self, text: str) -> list[int]:
        """Text inside a sequence (tool output, a continuation) -> ids, no special tokens."""
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# The embedded tasks' character tokenizers other than the arithmetic one, by the class name a checkpoint's
# config.json gives them (`tokenizer_class`, HF's key): model.tokenizer=arithmetic (the embedded kind) then
# takes the one the checkpoint was trained on. A name not listed here keeps the arithmetic tokenizer.
EMBEDDED_TOKENIZERS = {"SquaresTokenizer": "miles_k3.tasks.squares:SquaresTokenizer"}


class ArithmeticTextTokenizer:
    """An embedded task's character tokenizer: the arithmetic task's (`ArithmeticTokenizer`), or `task_tokenizer`
    (the squares task's, `embedded_tokenizer`). Prompts start with <bos>; decoding stops at <eos> and drops
    the special tokens (the squares media tokens too): `skip_special_tokens` changes nothing."""

    def __init__(self, task_tokenizer: Any = None) -> None:
        if task_tokenizer is None:
            from miles_k3.tasks.arithmetic import ArithmeticTokenizer

            task_tokenizer = ArithmeticTokenizer()
        self._tok = task_tokenizer
        self.eos_token_id = self._tok.eos_token_id

    @property
    def task_tokenizer(self) -> Any:
        """The task's own tokenizer (its vocabulary and special ids, e.g. the squares `media_pad_token_id`)."""
        return self._tok

    def encode_prompt(self, text: str) -> list[int]:
        return self._tok.encode(text, add_bos=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids)


def checkpoint_tokenizer_class(path: str | Path) -> str | None:
    """The `tokenizer_class` the checkpoint's config.json names (the VL wrapper's key, else its text
    config's), None if it names none. One-line ValueError for an unreadable config.json."""
    file = Path(path) / "config.json"
    try:
        d = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read the checkpoint config ({e})") from None
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    name = d.get("tokenizer_class", text.get("tokenizer_class"))
    return name if isinstance(name, str) else None


def embedded_tokenizer(path: str | None) -> ArithmeticTextTokenizer:
    """The embedded character tokenizer for the checkpoint at `path`: the one its config's `tokenizer_class`
    names in `EMBEDDED_TOKENIZERS` (k3-tiny-vl-squares: `SquaresTokenizer`), else the arithmetic one (the
    text assets, a random-init preset)."""
    name = None if path is None else checkpoint_tokenizer_class(path)
    if name not in EMBEDDED_TOKENIZERS:
        return ArithmeticTextTokenizer()
    module, cls = EMBEDDED_TOKENIZERS[name].split(":")
    return ArithmeticTextTokenizer(getattr(importlib.import_module(module), cls)())


class HFTokenizer:
    """transformers' AutoTokenizer from the checkpoint directory (trust_remote_code for Kimi's tokenizer)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        except OSError as e:  # transformers' way of saying: no tokenizer files here
            raise ValueError(f"'hf' finds no tokenizer in {path}: {e}") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} defines no eos token")
        self.eos_token_id = int(self._tok.eos_token_id)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (its chat template, special tokens), for the engine's server."""
        return self._tok


def load_tokenizer(kind: str, path: str | None) -> Tokenizer:
    """kind: "arithmetic" (the embedded character tokenizers: `embedded_tokenizer` picks the checkpoint's) or
    "hf" (`miles_k3.trainer.config.TOKENIZERS`); path: the checkpoint directory (None: a preset)."""
    if kind == "arithmetic":
        return embedded_tokenizer(path)
    if kind == "hf":
        return HFTokenizer(path)
    raise ValueError(f"tokenizer must be 'arithmetic' or 'hf', got {kind!r}")


def build_tokenizer(model: ModelCfg, config: K3Config) -> Tokenizer:
    """The run's tokenizer, its eos checked against the model's vocabulary."""
    tok = load_tokenizer(model.tokenizer, model.path)
    if tok.eos_token_id >= config.vocab_size:
        raise ValueError(f"eos id {tok.eos_token_id} is outside the model's vocabulary ({config.vocab_size})")
    return tok


def load_base_config(model: ModelCfg) -> K3Config:
    """The model's config alone (what a driver that holds no weights needs)."""
    if model.path is not None:
        return K3Config.from_json_file(Path(model.path) / "config.json")
    overrides: dict[str, int] = {} if model.vocab_size is None else {"vocab_size": model.vocab_size}
    if model.tokenizer == "arithmetic":
        # A preset's special ids are Kimi's (163584...); a random-init preset run on the arithmetic task
        # speaks the task's vocabulary, so its <pad>/<bos>/<eos> are the task tokenizer's.
        from miles_k3.tasks.arithmetic import ArithmeticTokenizer

        overrides.update(pad_token_id=ArithmeticTokenizer.pad_token_id, bos_token_id=ArithmeticTokenizer.bos_token_id,
                         eos_token_id=ArithmeticTokenizer.eos_token_id)
    return K3Config.from_preset(model.preset, **overrides)
