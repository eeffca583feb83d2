"""Images in prompts: Kimi's XTML media blocks, the pad positions the tower's features replace, image
references and data URLs.

A rendered prompt holds one ``<|kimi_image_placeholder|>`` per image (the chat templates write it for each
image content part, in order; a dataset string writes it by hand). Before tokenizing, `expand_media_prompt`
replaces the i-th placeholder by image i's block, exactly as the published K3 loaders do (vLLM's
``_get_prompt_updates``, sglang's K3 processor)::

    <|media_begin|>image {W}x{H}<|media_content|><|media_pad|> x N<|media_end|>

with W x H the image's ORIGINAL size (``ProcessedImage.size``: the published processors take it from the
image before the resize; the resize shows only in N), one space after ``image``, ``<|media_content|>``
straight after the header, and N = ``ProcessedImage.num_tokens`` (the merged patch count). After tokenizing,
`media_pad_positions` finds each image's run of ``<|media_pad|>`` ids: the positions whose embeddings the
projected features replace (`miles_k3.model.MediaEmbeds`). `prompt_encoder` does both for a row of text or
chat messages: what `miles-serve` and `miles-k3 generate` encode a prompt with images by.

An image a prompt names is an `ImageRef` until something needs its pixels: a path (read when processed) or
a data URL (decoded when processed), so text-only data never touches an image and a large dataset keeps its
images on disk.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from miles_k3.data.messages import check_messages

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
MEDIA_TOKENS = (MEDIA_PAD, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END)
IMAGE_PART_TYPES = ("image_url", "image")

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<data>.*)", re.DOTALL)


def image_block(image: Any) -> str:
    """The XTML block of one processed image (anything with ``size`` (W, H) and ``num_tokens``)."""
    w, h = image.size
    return f"{MEDIA_BEGIN}image {w}x{h}{MEDIA_CONTENT}{MEDIA_PAD * image.num_tokens}{MEDIA_END}"


def expand_media_prompt(text: str, images: Sequence[Any]) -> str:
    """``text`` with its i-th image placeholder replaced by `image_block` (images[i]). ValueError naming
    both counts when the placeholders and the images differ in number."""
    parts = text.split(IMAGE_PLACEHOLDER)
    if len(parts) - 1 != len(images):
        raise ValueError(
            f"prompt has {len(parts) - 1} image placeholder(s) {IMAGE_PLACEHOLDER} but "
            f"{len(images)} image(s) were given"
        )
    out = [parts[0]]
    for image, rest in zip(images, parts[1:]):
        out += [image_block(image), rest]
    return "".join(out)


def media_pad_positions(token_ids: Iterable[Any], images: Sequence[Any], pad_token_id: int) -> list[range]:
    """The token positions of each image's ``<|media_pad|>`` run, in order: range i covers image i.

    ValueError when the runs and the images differ in number, or a run's length is not its image's
    ``num_tokens`` (naming the image and both numbers): a prompt tokenized from other images, or a
    tokenizer that splits the pad token, fails here instead of splicing features into the wrong places.
    """
    runs: list[range] = []
    start = None
    for n, t in enumerate(_ints(token_ids) + [None]):  # the None closes a run at the end
        if t == pad_token_id and start is None:
            start = n
        elif t != pad_token_id and start is not None:
            runs.append(range(start, n))
            start = None
    if len(runs) != len(images):
        raise ValueError(
            f"token ids hold {len(runs)} media pad run(s) (id {pad_token_id}) but {len(images)} image(s) were given"
        )
    for i, (run, image) in enumerate(zip(runs, images)):
        if len(run) != image.num_tokens:
            raise ValueError(
                f"image {i}: its media pad run at position {run.start} has {len(run)} token(s), "
                f"the image takes {image.num_tokens}"
            )
    return runs


def prompt_encoder(tokenizer: Any, images: Sequence[Any] | None = None, pad_token_id: int | None = None):
    """`encode(row) -> ids` for a request's or a prompts file's row: `{"prompt": text}` (`tokenizer.encode`:
    a prompt, special tokens added) or `{"messages": [...]}` (`tokenizer.encode_chat`: the chat template),
    as `rollout.server.tokenization.ServerTokenizer` provides them; `miles-serve` and `miles-k3 generate`
    both encode through it. With `images` (processed images, in placeholder order) each placeholder is
    expanded to its image's block first (`expand_media_prompt`; in messages, the string contents in order),
    and the ids must hold one pad run of `pad_token_id` per image of its length (a tokenizer that splits the
    pad fails here, `media_pad_positions`). One-line ValueError naming what does not match."""

    def expand(text: str, at: int) -> tuple[str, int]:
        n = text.count(IMAGE_PLACEHOLDER)
        return expand_media_prompt(text, images[at : at + n]), at + n

    def encode(row: dict) -> list[int]:
        if "prompt" in row and "messages" in row:
            raise ValueError('give "prompt" or "messages", not both')
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise ValueError(f"prompt must be a non-empty string, got {row['prompt']!r}"[:120])
            text = expand_media_prompt(row["prompt"], images) if images else row["prompt"]
            ids = tokenizer.encode(text)
        elif "messages" in row:
            messages, at = check_messages(row["messages"], content_parts_text), 0
            if images:
                messages = [dict(m) for m in messages]
                for m in messages:
                    if isinstance(m, dict) and isinstance(m.get("content"), str):
                        m["content"], at = expand(m["content"], at)
                if at != len(images):
                    raise ValueError(
                        f"the messages hold {at} image placeholder(s) {IMAGE_PLACEHOLDER} but "
                        f"{len(images)} image(s) were given (--image)"
                    )
            ids = tokenizer.encode_chat(messages)
        else:
            raise ValueError('expected {"prompt": "text"} or {"messages": [...]}')
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        if images:
            media_pad_positions(ids, images, pad_token_id)
        return ids

    return encode


def _ints(ids: Iterable[Any]) -> list[int]:
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return [int(t) for t in ids]


# --- data URLs ---


def decode_data_url(url: str, *, where: str = "image_url") -> bytes:
    """The bytes of a base64 ``data:image/...;base64,...`` URL. One-line ValueError (starting with ``where``)
    for any other URL (images are never fetched over the network), a non-image type, or bad base64."""
    if not isinstance(url, str):
        raise ValueError(f"{where}: must be a data URL string, got {type(url).__name__}")
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise ValueError(f"{where}: only data URLs (data:image/png;base64,...) are accepted, got {shown!r}")
    m = _DATA_URL.fullmatch(url)
    if m is None:
        raise ValueError(f"{where}: malformed data URL (no ',' after the media type)")
    mime = (m["mime"] or "").lower()
    if not mime.startswith("image/"):
        raise ValueError(f"{where}: data URL has media type {mime or 'text/plain'!r}; expected image/*")
    if "base64" not in [p.strip().lower() for p in m["params"].split(";")]:
        raise ValueError(f"{where}: data URL is not base64 (write data:{mime};base64,...)")
    try:
        return base64.b64decode(m["data"].strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: data URL holds invalid base64 ({e})") from None


def encode_data_url(data: bytes, mime: str = "image/png") -> str:
    """``data:<mime>;base64,<data>``: what `decode_data_url` reads back to ``data``."""
    if not mime.startswith("image/"):
        raise ValueError(f"mime: must be an image/* type, got {mime!r}")
    return f"data:{mime};base64,{base64.b64encode(bytes(data)).decode('ascii')}"


# --- image references ---


@dataclass(frozen=True)
class ImageRef:
    """An image a prompt names, not read yet: ``source`` is an absolute path, a data URL, or an image file's
    bytes. `load` returns what `miles_k3.data.image_processor.ImageProcessor.process` takes (the path, or the
    decoded bytes); `name` labels it in errors."""

    source: str | bytes
    where: str = ""  # the prompt it came from (file and line), for errors

    @property
    def is_data_url(self) -> bool:
        return isinstance(self.source, str) and self.source.startswith("data:")

    @property
    def name(self) -> str:
        if isinstance(self.source, bytes):
            what = f"image bytes ({len(self.source)} bytes)"
        elif self.is_data_url:
            what = f"data URL ({len(self.source)} chars)"
        else:
            what = self.source
        return f"{self.where}: {what}" if self.where else what

    def load(self) -> str | bytes:
        """The path (the processor reads it) or the image file's bytes."""
        if self.is_data_url:
            return decode_data_url(self.source, where=self.name)
        return self.source

    def fingerprint(self) -> str:
        """A short stable identity for dataset fingerprints: the path, or sha256 of inline data."""
        if isinstance(self.source, bytes):
            return "sha256:" + hashlib.sha256(self.source).hexdigest()
        if self.is_data_url:
            return "sha256:" + hashlib.sha256(self.source.encode("utf-8")).hexdigest()
        return self.source


def image_ref(value: Any, *, base_dir: Path | None, where: str) -> ImageRef:
    """An `ImageRef` from a dataset or message value: a data URL, bytes, or a path (relative to ``base_dir``).
    ValueError naming ``where`` for other values, a path when ``base_dir`` is None (paths are refused: the
    server takes data URLs only), and a path that is not a file."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(bytes(value), where)
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(f"{where}: an image must be a path, a data URL or bytes, got {value!r}"[:200])
    value = os.fspath(value)
    if value.startswith("data:"):
        return ImageRef(value, where)
    if base_dir is None:
        raise ValueError(f"{where}: image paths are not accepted here; send the image as a data URL")
    path = (Path(base_dir) / value).resolve()
    if not path.is_file():
        raise ValueError(f"{where}: image file {value!r} not found (looked at {path})")
    return ImageRef(str(path), where)


def content_part_image(part: dict[str, Any]) -> Any:
    """The image value of an OpenAI-style image part: ``{"type": "image_url", "image_url": {"url": ...}}``
    (or ``"image_url": "<url>"``), or ``{"type": "image", "image": <path | data URL | bytes>}``. ValueError
    starting with ``part`` when the value is missing."""
    kind = part.get("type")
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if value is None:
        shape = '{"url": "data:image/...;base64,..."}' if kind == "image_url" else "a path or data URL"
        raise ValueError(f"part: type {kind!r} needs {kind!r}: {shape}")
    return value


def message_images(messages: Sequence[Any], *, base_dir: Path | None, where: str = "prompt") -> list[ImageRef]:
    """The images of a chat-message list in the order their placeholders appear: message by message, part by
    part (the chat templates write one placeholder per image part, in that order). Messages whose content is
    a string hold none. Errors name the message and part index (and ``where``)."""
    refs = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                at = f"{where}: message {i} part {j}"
                try:
                    value = content_part_image(part)
                except ValueError as e:
                    raise ValueError(f"{at}: {str(e).removeprefix('part: ')}") from None
                if part["type"] == "image_url" and not (isinstance(value, str) and value.startswith("data:")):
                    decode_data_url(value, where=at)  # raises: an image_url part is a data URL, never a path
                refs.append(image_ref(value, base_dir=base_dir, where=at))
    return refs


def content_parts_text(parts: list[Any], where: str) -> str:
    """OpenAI-style content parts as one string: text parts' text, each image part (``image_url``, ``image``)
    as one ``<|kimi_image_placeholder|>``, in order, with nothing between parts (as K3's own encoder joins
    them). The images themselves are read by `message_images`, in the same order.
    ValueError "<where>[j]: ..." (``where``: the content's field, ``messages[i].content``) for a part of another
    type or without its text."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{j}]: a text part needs a string 'text'")
            out.append(part["text"])
        elif kind in IMAGE_PART_TYPES:
            content_part_image(part)  # fails here, at render time, when the part names no image
            out.append(IMAGE_PLACEHOLDER)
        else:
            raise ValueError(
                f"{where}[{j}]: expected an object with type 'text', 'image_url' or 'image', got {part!r}"[:300]
            )
    return "".join(out)
