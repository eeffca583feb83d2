"""Prompt datasets: a validated config, immutable records, and a loader for jsonl and parquet.

The loader reads the whole file into memory (RL prompt sets are thousands to a few million rows) and checks
every row before training starts, so a bad row fails the run at load time with its file and line, not hours
later when the sampler reaches it.

Multimodal rows: a row's ``images`` (`PromptDataConfig.images_key`) lists its images in placeholder order,
each a path relative to the data file, a data URL (``data:image/png;base64,...``: how a JSONL file writes
an image inline), or bytes (a parquet binary column); a chat-message prompt may instead carry them as image
content parts. Each file is checked to exist at load time, but no image is read or decoded until the
record's `ImageRef` is processed, so text-only data never touches the image code.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from miles_k3.data.chat_template import render_prompt, validate_template
from miles_k3.data.k3_chat import check_tools
from miles_k3.data.media import IMAGE_PLACEHOLDER, ImageRef, image_ref, message_images

FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class PromptDataConfig:
    """Where prompts come from and how they become engine input. Validated on construction: ValueError
    starting with `PromptDataConfig.<field>`. The file itself is read (and every row checked) by
    `load_prompts`."""

    path: str  # a .jsonl (one JSON object a line; blank lines skipped) or .parquet file; the suffix picks
    prompt_key: str = "prompt"  # holds a non-empty string or a list of chat messages [{role, content}, ...]
    # the reference answer handed to reward plugins (any JSON value but null), required in every row;
    # None: the data has no reference (the reward scores responses alone)
    label_key: str | None = "label"
    # keys copied into PromptRecord.metadata, each required in every row; None: every key other than the
    # prompt and label keys
    metadata_keys: tuple[str, ...] | None = None
    # a row's images (a list; absent: the row is text-only), one per image placeholder in its prompt, in order;
    # None: rows carry no images (the key is then ordinary metadata)
    images_key: str | None = "images"
    # "hf": the tokenizer's own template (HF checkpoints) | "k3": K3's own chat encoding, straight to ids
    # (miles_k3.data.k3_chat) | None: the prompt verbatim | "chatml": the built-in template (embedded tiny
    # models) | a format string with {prompt} (miles_k3.data.chat_template)
    chat_template: str | None = None
    system_prompt: str | None = None  # needs a template that reads it ({system}, chatml, hf or k3)
    # chat_template "k3": the prompt opens the think channel (the reply reasons first); false: the response channel
    thinking: bool = True
    # chat_template "k3": a row's tools offered to the model (OpenAI's list of functions; absent: none); None: no tools
    tools_key: str | None = None
    shuffle: bool = True  # PromptSampler: a fresh permutation each epoch; false: file order
    seed: int = 0  # PromptSampler: seeds the epoch permutations
    drop_last: bool = False  # PromptSampler: an epoch's last, short batch is skipped instead of wrapping

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"PromptDataConfig.{name} {rule}, got {getattr(self, name)!r}")

        # Hydra hands over strings and lists; normalize to str / tuple so the frozen config is hashable.
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.path, str) or not self.path:
            raise fail("path", "must be a non-empty path string")
        if Path(self.path).suffix.lower() not in FORMATS:
            raise fail("path", f"must end in one of {sorted(FORMATS)} (the suffix picks the format)")
        if not isinstance(self.prompt_key, str) or not self.prompt_key:
            raise fail("prompt_key", "must be a non-empty string")
        if self.label_key is not None and (not isinstance(self.label_key, str) or not self.label_key):
            raise fail("label_key", "must be None or a non-empty string")
        if self.label_key == self.prompt_key:
            raise fail("label_key", "must differ from prompt_key")
        if self.images_key is not None:
            if not isinstance(self.images_key, str) or not self.images_key:
                raise fail("images_key", "must be None or a non-empty string")
            if self.images_key in (self.prompt_key, self.label_key):
                raise fail("images_key", "must differ from prompt_key and label_key")
        if self.tools_key is not None:
            if not isinstance(self.tools_key, str) or not self.tools_key:
                raise fail("tools_key", "must be None or a non-empty string")
            if self.tools_key in (self.prompt_key, self.label_key, self.images_key):
                raise fail("tools_key", "must differ from prompt_key, label_key and images_key")
            if self.chat_template != "k3":
                raise fail("tools_key", "needs chat_template='k3' (the template that renders tools)")
        if not isinstance(self.thinking, bool):
            raise fail("thinking", "must be a bool")
        if not self.thinking and self.chat_template != "k3":
            raise fail("thinking", "false needs chat_template='k3' (the template with a think channel)")
        if self.metadata_keys is not None:
            if isinstance(self.metadata_keys, str):
                raise fail(
                    "metadata_keys",
                    f"must be None or a sequence of keys, not a string (write [{self.metadata_keys}] for one key)",
                )
            try:
                keys = tuple(self.metadata_keys)
            except TypeError:
                raise fail("metadata_keys", "must be None or a sequence of keys") from None
            for k in keys:
                if not isinstance(k, str) or not k:
                    raise fail("metadata_keys", f"entries must be non-empty strings ({k!r} is not)")
                if k in (self.prompt_key, self.label_key, self.images_key):
                    raise fail("metadata_keys", f"must not list the prompt, label or images key {k!r}")
                if k == self.tools_key:
                    raise fail("metadata_keys", f"must not list the tools key {k!r}")
            if len(set(keys)) != len(keys):
                raise fail("metadata_keys", "must not repeat a key")
            object.__setattr__(self, "metadata_keys", keys)
        try:
            validate_template(self.chat_template, self.system_prompt)
        except ValueError as e:  # its messages start with the field: chat_template / system_prompt
            raise ValueError(f"PromptDataConfig.{e}") from None
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "must be a bool")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise fail("seed", "must be an int")

    @property
    def format(self) -> str:
        """``"jsonl"`` or ``"parquet"``, from the path's suffix."""
        return FORMATS[Path(self.path).suffix.lower()]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, ready for the engine.

    ``index`` is the record's 0-based position in the dataset (blank jsonl lines not counted); ``prompt`` the
    rendered string the engine tokenizes; ``raw_prompt`` the value as stored (string or message list);
    ``label`` the reference answer (None when the config has no label key); ``metadata`` the selected extra
    keys; ``images`` the prompt's images, one per image placeholder in ``prompt``, in order (empty for a
    text-only record; not read yet: `miles_k3.data.media.ImageRef`). Records are shared between batches: treat
    ``raw_prompt`` and ``metadata`` as read-only.
    """

    index: int
    prompt: str
    raw_prompt: str | list[dict[str, str]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple[ImageRef, ...] = ()


def load_prompts(
    config: PromptDataConfig, apply_chat: Callable[[list[dict[str, str]]], str] | None = None
) -> list[PromptRecord]:
    """Read, check and render every row of ``config.path``. `apply_chat`: the tokenizer's chat template
    (`miles_k3.data.hf_chat.hf_chat_renderer`), which chat_template "hf" needs; "k3" needs K3's encoding
    (`miles_k3.data.k3_chat.K3ChatPrompts.render`: a row's messages and tools -> its ids).

    Raises FileNotFoundError for a missing file, and ValueError naming the file, the jsonl line (1-based) or
    the parquet row (0-based, as pyarrow and pandas count) and the key for: malformed JSON, a line that is not
    a JSON object, a missing prompt / label / listed metadata key, a null label, a prompt that is neither a
    non-empty string nor a valid message list, a message list the template cannot render, an unreadable
    parquet file, and an empty dataset; for images: an images value that is not a list, an entry that is
    neither a path, a data URL nor bytes, a missing image file (naming the path), images both in content parts
    and under the images key, and a placeholder count that differs from the image count.
    """
    path = Path(config.path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompt dataset not found")
    rows = read_jsonl_rows(path) if config.format == "jsonl" else _read_parquet(path)
    if config.chat_template in ("hf", "k3") and apply_chat is None:
        raise ValueError(
            f"chat_template {config.chat_template!r} needs the tokenizer's template (load_prompts(config, apply_chat))"
        )
    records = [_to_record(i, row, where, config, apply_chat, path.parent) for i, (where, row) in enumerate(rows)]
    if not records:
        raise ValueError(f"{path}: empty dataset (no records)")
    return records


def dataset_fingerprint(records: list[PromptRecord]) -> str:
    """sha256 over every record's rendered prompt, raw prompt, label and metadata, in order.

    It identifies the data a sampler position points into: a changed file, row order, or rendering
    (chat_template / system_prompt) changes it, so resuming a sampler against it fails loudly. A record's
    images count by path or inline-data hash (not file contents: nothing is read); a text-only record hashes
    as it did before images existed.
    """
    h = hashlib.sha256()
    for r in records:
        # default=repr covers parquet values JSON cannot encode (bytes, datetime, Decimal) deterministically.
        item = [r.prompt, r.raw_prompt, r.label, r.metadata]
        if r.images:
            item.append([ref.fingerprint() for ref in r.images])
        h.update(json.dumps(item, sort_keys=True, ensure_ascii=False, default=repr).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def read_jsonl_rows(path: Path):
    """(where, row) for each non-blank line of a JSONL file, `where` = "<path> line <n>"; ValueError naming the
    line for bad UTF-8, bad JSON or a value that is not an object."""
    # Decode line by line from bytes so an encoding error can name its line too.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a leading BOM
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _read_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for corrupt files
        raise ValueError(f"{path}: not a readable parquet file: {e}") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i} (0-based)", row


def _to_record(
    index: int, row: dict[str, Any], where: str, c: PromptDataConfig, apply_chat=None, base_dir: Path | None = None
) -> PromptRecord:
    if c.prompt_key not in row:
        raise ValueError(f"{where}: missing prompt key {c.prompt_key!r} (keys: {sorted(row)})")
    raw = row[c.prompt_key]
    tools = None
    if c.tools_key is not None and row.get(c.tools_key) is not None:
        try:
            tools = check_tools(row[c.tools_key], "tools")
        except ValueError as e:
            raise ValueError(f"{where}: key {c.tools_key!r}: {e}") from None
    try:
        prompt = render_prompt(raw, c.chat_template, c.system_prompt, apply_chat, tools)
    except ValueError as e:
        # render_prompt's messages start with "prompt:"; name the configured key instead.
        msg = str(e).removeprefix("prompt: ")
        raise ValueError(f"{where}: key {c.prompt_key!r}: {msg}") from None
    label = None
    if c.label_key is not None:
        if c.label_key not in row:
            raise ValueError(
                f"{where}: missing label key {c.label_key!r} (keys: {sorted(row)}; "
                "set label_key=None for unlabeled data)"
            )
        label = row[c.label_key]
        if label is None:
            # A null reference would score every sample as wrong: a data bug, not a zero reward.
            raise ValueError(f"{where}: label key {c.label_key!r} is null")
    images = _images(row, raw, prompt, where, c, base_dir)
    if c.metadata_keys is None:
        metadata = {k: v for k, v in row.items() if k not in (c.prompt_key, c.label_key, c.images_key, c.tools_key)}
    else:
        missing = [k for k in c.metadata_keys if k not in row]
        if missing:
            raise ValueError(f"{where}: missing metadata key {missing[0]!r} (keys: {sorted(row)})")
        metadata = {k: row[k] for k in c.metadata_keys}
    return PromptRecord(index=index, prompt=prompt, raw_prompt=raw, label=label, metadata=metadata, images=images)


def _images(
    row: dict[str, Any], raw: Any, prompt: str, where: str, c: PromptDataConfig, base_dir: Path | None
) -> tuple[ImageRef, ...]:
    """The row's image references (paths checked to exist, nothing read), matched against the placeholders."""
    base_dir = base_dir if base_dir is not None else Path(".")
    parts = (
        message_images(raw, base_dir=base_dir, where=f"{where}: key {c.prompt_key!r}") if isinstance(raw, list) else []
    )
    listed: list[ImageRef] = []
    if c.images_key is not None and row.get(c.images_key) is not None:
        value = row[c.images_key]
        if not isinstance(value, (list, tuple)):
            raise ValueError(
                f"{where}: key {c.images_key!r} must be a list of images (paths, data URLs), got {type(value).__name__}"
            )
        listed = [
            image_ref(v, base_dir=base_dir, where=f"{where}: key {c.images_key!r} item {k}")
            for k, v in enumerate(value)
        ]
    if parts and listed:
        raise ValueError(
            f"{where}: images both in the prompt's content parts ({len(parts)}) and under key "
            f"{c.images_key!r} ({len(listed)}); give them one way"
        )
    images = tuple(parts or listed)
    n = prompt.count(IMAGE_PLACEHOLDER)
    if n != len(images):
        raise ValueError(
            f"{where}: the prompt has {n} image placeholder(s) {IMAGE_PLACEHOLDER} but the row "
            f"has {len(images)} image(s)"
        )
    return images
