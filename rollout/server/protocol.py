"""What both HTTP APIs share: reading a request body, typed field checks that name the field, errors as
JSON, server-sent events, and the request-level checks against the engine (length, vocabulary, model).

Every refusal is a `RequestError` whose message names the field (`temperature must be >= 0, got -1`);
`error_body` lays it out as OpenAI does (`{"error": {"message", "type", "param", "code"}}`), which the
`openai` package reads into its exceptions and SGLang clients read as `error.message`.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout.server.generation import GenerationService, RequestError
from rollout.server.tokenization import ServerTokenizer

_MISSING = object()
# response ids: one random prefix per process and a counter (uuid4 per request reads os.urandom, which
# cost 0.6 ms a call on the benchmark machine)
_ID_PREFIX, _ID_COUNTER = uuid.uuid4().hex[:16], itertools.count()


def new_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


@dataclass
class ServerContext:
    """What the routes read: the generation service, the tokenizer, the model's names and limits."""

    service: GenerationService
    tokenizer: ServerTokenizer
    model_name: str  # the base model's served name
    adapters: tuple[str, ...]  # adapter names, each a model name too
    model_path: str
    vocab_size: int
    max_seq_len: int
    # the checkpoint's image processor and media pad id (`rollout.server.images`); None: a text-only model
    image_processor: Any = None
    media_pad_id: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    pool_tokens: int | None = None  # the most prompt + generated tokens one request's KV pages can hold
    memory_mb: float | None = None  # the engine's --memory-mb, which sets pool_tokens
    weight_version: str = "default"  # `/update_weight_version`'s; in every meta_info
    adapter_paths: dict[str, str] = field(default_factory=dict)  # adapters loaded through the control API

    def check_length(self, prompt_len: int, max_new: int | None, key: str, default: int | None) -> int:
        """`check_length` against max_seq_len and the KV pool (a 400 naming `key` and --memory-mb)."""
        return check_length(prompt_len, max_new, self.max_seq_len, key, default, self.pool_tokens, self.memory_mb)

    def adapter_for(self, model: Any, key: str = "model") -> str | None:
        """The adapter a model name selects (None: the base). 404 for a name this server does not serve."""
        if not isinstance(model, str):
            raise RequestError(f"{key} must be a string (a served model name), got {_show(model)}", param=key)
        if model == self.model_name:
            return None
        if model in self.adapters:
            return model
        served = [self.model_name, *self.adapters]
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {served}",
            status=404,
            param=key,
            code="model_not_found",
        )


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def error_body(e: RequestError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def sse(payload: Any) -> bytes:
    """One server-sent event; the stream ends with `sse("[DONE]")`."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Fields:
    """Typed reads of one JSON object's fields. JSON null reads as absent (the default). `finish()`
    refuses any field nobody read: a misspelt parameter is an error, not silently ignored."""

    def __init__(self, obj: Any, where: str = ""):
        if not isinstance(obj, dict):
            raise RequestError(f"{where or 'the body'} must be a JSON object, got {type(obj).__name__}", param=where)
        self.obj, self.where, self.seen = obj, where, set()

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, rule: str) -> RequestError:
        return RequestError(f"{self.path(key)} {rule}, got {_show(self.obj.get(key))}", param=self.path(key))

    def raw(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        value = self.obj.get(key)
        return default if value is None else value

    def required(self, key: str) -> Any:
        value = self.raw(key, _MISSING)
        if value is _MISSING:
            raise RequestError(f"{self.path(key)} is required", param=self.path(key))
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "must be true or false")
        return value

    def int(self, key: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
        value = self.raw(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, "must be an integer")
        if low is not None and value < low:
            raise self.fail(key, f"must be >= {low}")
        if high is not None and value > high:
            raise self.fail(key, f"must be <= {high}")
        return value

    def number(
        self, key: str, default: float, low: float | None = None, high: float | None = None, *, open_low: bool = False
    ) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, "must be a finite number")
        if low is not None and (value < low or (open_low and value == low)):
            raise self.fail(key, f"must be {'>' if open_low else '>='} {low}")
        if high is not None and value > high:
            raise self.fail(key, f"must be <= {high}")
        return float(value)

    def str(self, key: str, default: str | None) -> str | None:
        value = self.raw(key, default)
        if value is not None and not isinstance(value, str):
            raise self.fail(key, "must be a string")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        """A string or a list of strings (stop sequences); empty strings are refused."""
        value = self.raw(key, ())
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise self.fail(key, "must be a non-empty string or a list of them")
        return tuple(items)

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.raw(key, ())
        if not isinstance(value, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value
        ):
            raise self.fail(key, "must be a list of token ids (integers >= 0)")
        return tuple(value)

    def neutral(self, key: str, *neutral: Any) -> None:
        """A field this server does not implement: accepted only at a value that changes nothing."""
        value = self.raw(key, None)
        if value is not None and value not in neutral:
            raise self.fail(key, f"is not supported by this server (only {', '.join(map(repr, neutral)) or 'null'})")

    def ignore(self, *keys: str) -> None:
        """Fields that carry no meaning for generation here (user ids, metadata): read and dropped."""
        self.seen.update(keys)

    def finish(self) -> None:
        unknown = sorted(set(self.obj) - self.seen)
        if unknown:
            raise RequestError(f"unknown field {self.path(unknown[0])!r}", param=self.path(unknown[0]))


def prompt_ids(value: Any, key: str, vocab_size: int) -> list[int]:
    """A prompt given as token ids: a non-empty list of ints inside the vocabulary."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"{key} must be a non-empty list of token ids", param=key)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(f"{key} holds {_show(t)}, not a token id in [0, {vocab_size})", param=key)
    return list(value)


def check_length(
    prompt_len: int,
    max_new: int | None,
    max_seq_len: int,
    key: str,
    default: int | None,
    pool_tokens: int | None = None,
    memory_mb: float | None = None,
) -> int:
    """The tokens to generate: `max_new` as asked (a 400 naming `key` when prompt + it exceeds the
    engine's max_seq_len, or the `pool_tokens` its KV pool of `memory_mb` MiB holds for one request), or, when
    not asked, `default` capped to what still fits (all of it: None)."""
    if pool_tokens is not None and pool_tokens < max_seq_len:
        if prompt_len >= pool_tokens:
            raise RequestError(
                f"the prompt has {prompt_len} tokens; the server's KV pool (--memory-mb {memory_mb:g}) holds "
                f"{pool_tokens} tokens of one request, which leaves no room to generate",
                param="prompt",
            )
        if max_new is not None and prompt_len + max_new > pool_tokens:
            raise RequestError(
                f"{key} ({max_new}) + the prompt's {prompt_len} tokens exceeds the {pool_tokens} tokens the "
                f"server's KV pool (--memory-mb {memory_mb:g}) holds for one request; lower {key} or serve with "
                "a larger --memory-mb",
                param=key,
            )
        max_seq_len = pool_tokens
    room = max_seq_len - prompt_len
    if room < 1:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; the server's max_seq_len ({max_seq_len}) leaves no room to generate",
            param="prompt",
        )
    if max_new is None:
        return room if default is None else min(default, room)
    if max_new > room:
        raise RequestError(
            f"{key} ({max_new}) + the prompt's {prompt_len} tokens exceeds the server's max_seq_len ({max_seq_len})",
            param=key,
        )
    return max_new


def encode(fn, value: Any, key: str) -> list[int]:
    """Run a tokenizer call; its ValueError (a character outside the vocabulary, a template's refusal)
    becomes a 400 naming the field."""
    try:
        ids = fn(value)
    except ValueError as e:
        raise RequestError(f"{key}: {e}", param=key) from None
    if not ids:
        raise RequestError(f"{key} encodes to no tokens", param=key)
    return ids
