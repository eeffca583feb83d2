"""The run's tokenizers: the embedded tasks' character tokenizers and transformers' AutoTokenizer, behind one
`Tokenizer` protocol that the trainer, rollout plugins, `miles-serve` (which wraps it) and `miles-k3 generate`
use alike, so a prompt string becomes the same ids in a training run and in a request.

    tok = load_tokenizer("arithmetic", "/ckpt")    # TOKENIZERS: "arithmetic" (embedded) or "hf" (AutoTokenizer)
    ids = tok.encode_prompt("12+7=")               # special tokens added as training adds them
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Protocol

TOKENIZERS = ("arithmetic", "hf")


class Tokenizer(Protocol):
    """The run's tokenizer, as the trainer, rollout plugins and the server (which wraps it) use it."""

    eos_token_id: int

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt string -> ids, special tokens added as training adds them."""

    def encode(self, text: str) -> list[int]:
        """Text inside a sequence (tool output, a continuation) -> ids, no special tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Decoder:
    """Text of a growing token sequence, delivered in pieces: `push(ids)` returns the text those tokens
    complete (held back while the tail decodes to an incomplete character), `finish()` the rest."""

    def __init__(self, decode):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the last `_prefix_text`; a window, not the whole text
        self._read = 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            # decode a window (the previous piece and the new tokens), not the whole text: O(1) per token,
            # and both strings start at the same token, so context-dependent spacing cancels out
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(prefix_text) :]
        return ""

    def finish(self) -> str:
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text) :]


# The embedded tasks' character tokenizers other than the arithmetic one, by the class name a checkpoint's
# config.json gives them (`tokenizer_class`, HF's key): the "arithmetic" kind (the embedded one) then takes
# the one the checkpoint was trained on. A name not listed here keeps the arithmetic tokenizer.
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


def embedded_tokenizer(path: str | Path | None) -> ArithmeticTextTokenizer:
    """The embedded character tokenizer for the checkpoint at `path`: the one its config's `tokenizer_class`
    names in `EMBEDDED_TOKENIZERS` (k3-tiny-vl-squares: `SquaresTokenizer`), else the arithmetic one (the
    text assets, a random-init preset: path None)."""
    name = None if path is None else checkpoint_tokenizer_class(path)
    if name not in EMBEDDED_TOKENIZERS:
        return ArithmeticTextTokenizer()
    module, cls = EMBEDDED_TOKENIZERS[name].split(":")
    return ArithmeticTextTokenizer(getattr(importlib.import_module(module), cls)())


class HFTokenizer:
    """transformers' AutoTokenizer from the checkpoint directory (trust_remote_code for Kimi's tokenizer)."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
        except OSError as e:  # transformers' way of saying: no tokenizer files here
            raise ValueError(f"'hf' finds no tokenizer in {path}: {e}") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} defines no eos token")
        self.eos_token_id = int(self._tok.eos_token_id)
        self.path = str(path)  # the checkpoint directory (its generation_config.json: `miles_k3.data.k3_chat`)

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


def load_tokenizer(kind: str, path: str | Path | None) -> Tokenizer:
    """kind: "arithmetic" (the embedded character tokenizers: `embedded_tokenizer` picks the checkpoint's) or
    "hf" (`TOKENIZERS`); path: the checkpoint directory (None: a preset, which only "arithmetic" serves)."""
    if kind == "arithmetic":
        return embedded_tokenizer(path)
    if kind == "hf":
        if path is None:
            raise ValueError("tokenizer 'hf' needs a checkpoint directory (the tokenizer is loaded from it)")
        return HFTokenizer(path)
    raise ValueError(f"tokenizer must be 'arithmetic' or 'hf', got {kind!r}")


def preset_token_ids(kind: str) -> dict[str, int]:
    """The special-token ids a random-init preset takes when run with tokenizer `kind`
    (`miles_k3.model.base.load_base`'s `token_ids`): a preset's own are Kimi's (163584...); one run on the
    arithmetic task speaks the task's vocabulary, so its <pad>/<bos>/<eos> are the task tokenizer's. "hf"
    needs a checkpoint, so it sets none."""
    if kind != "arithmetic":
        return {}
    from miles_k3.tasks.arithmetic import ArithmeticTokenizer

    return {
        "pad_token_id": ArithmeticTokenizer.pad_token_id,
        "bos_token_id": ArithmeticTokenizer.bos_token_id,
        "eos_token_id": ArithmeticTokenizer.eos_token_id,
    }
