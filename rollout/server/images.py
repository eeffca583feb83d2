"""Chat messages' content parts and images in requests: OpenAI `image_url` content parts (chat) and SGLang's
`image_data` (/generate), read into the served checkpoint's own `ProcessedImage`s and the prompt ids that hold
their pads.

    parts = []                                            # ImageParts, in the order the prompt shows them
    messages = [message_text(i, m, parts) for i, m in enumerate(body["messages"])]
    images = await asyncio.to_thread(process_images, ctx, parts)   # off the event loop: PIL decode + resize
    ids = images_prompt_ids(ctx, {"messages": messages}, images, "messages")

An image arrives as a data URL (`data:image/png;base64,...`; SGLang's raw base64 too) and nothing else: an
http(s) URL or a path is a 400 naming the part, the server fetches and reads nothing. Each image is resized
by the checkpoint's preprocessor config (`Served.image_processor`), its placeholder expanded to Kimi's XTML
block and the tokenized pad runs checked against it: the same flow as `miles-k3 generate --image`
(`miles_k3.data.media.prompt_encoder`, shared, not copied). The features are computed by the engine, once
per image content while requests hold them (`rollout.media.MediaEncoder`), so the n samples of a request
and a repeated image share one tower forward, and the prefix cache keys the pads on the content.

Every refusal is a `RequestError` (400) whose `param` is the part: `messages[1].content[0].image_url` for a
URL that is not a data URL, a corrupt image, or any image sent to a text-only model.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from miles_k3.data.media import IMAGE_PLACEHOLDER, decode_data_url, prompt_encoder
from miles_k3.data.messages import CHAT_ROLES, check_message
from rollout.server.generation import RequestError
from rollout.server.protocol import Fields, ServerContext, encode

__all__ = [
    "CHAT_ROLES",
    "IMAGE_PLACEHOLDER",
    "ImagePart",
    "image_part",
    "images_prompt_ids",
    "message_text",
    "process_images",
]


@dataclass(frozen=True)
class ImagePart:
    """One image of a request, not decoded yet."""

    param: str  # the field that holds it, as errors name it: messages[1].content[0].image_url, image_data[0]
    url: str  # a data URL, or (SGLang's image_data) the image file's base64
    raw_base64: bool = False  # `url` is bare base64 (SGLang), not a data URL


def message_text(i: int, message: Any, images: list) -> dict[str, str]:
    """One chat message as {role, content}, checked by the shared validator
    (`miles_k3.data.messages.check_message`: role, content present, a string or content parts). A text part is
    its text; an `image_url` part (`image_part`, appended to `images` in order) is one
    `<|kimi_image_placeholder|>`, as the chat templates render image parts
    (`miles_k3.data.media.content_parts_text`). ValueError naming the message and part."""

    def parts(content: list, field: str) -> str:
        texts = []
        for j, part in enumerate(content):
            where = f"{field}[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                images.append(image_part(part, where))
                texts.append(IMAGE_PLACEHOLDER)
            elif kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.text must be a string, got {type(part.get('text')).__name__}")
                texts.append(part["text"])
            else:
                shown = str(part if kind is None else repr(kind))[:80]
                raise ValueError(f'{where} must be a content part of type "text" or "image_url", got {shown}')
        return "".join(texts)

    return check_message(i, message, parts)


def image_part(part: dict[str, Any], where: str) -> ImagePart:
    """An OpenAI image part `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (`detail` is
    read and ignored: the checkpoint's processor decides the resolution). ValueError naming the field."""
    try:
        f = Fields(part, where)
        f.raw("type")
        g = Fields(f.required("image_url"), f.path("image_url"))
        url = g.str("url", None)
        if url is None:
            raise g.fail("url", "is required (a data URL: data:image/png;base64,...)")
        g.ignore("detail")
        g.finish()
        f.finish()
    except RequestError as e:
        raise ValueError(e.message) from None
    return ImagePart(f"{where}.image_url", url)


def data_image_parts(value: Any, key: str) -> list[ImagePart]:
    """SGLang's `image_data` of one prompt: a data URL or base64 string, or a list of them."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v for v in items):
        raise RequestError(f"{key} must be a data URL or base64 string, or a non-empty list of them", param=key)
    parts = []
    for i, v in enumerate(items):
        where = key if isinstance(value, str) else f"{key}[{i}]"
        bare = not v.startswith("data:") and "://" not in v and not v.startswith("/")
        parts.append(ImagePart(where, v, raw_base64=bare))
    return parts


def process_images(ctx: ServerContext, parts: list[ImagePart]) -> list:
    """Each part's `ProcessedImage` by the checkpoint's processor, in order (the same content is decoded
    once). RequestError (400) naming the first part that fails, or the first part on a text-only model."""
    if not parts:
        return []
    if ctx.image_processor is None:
        raise RequestError(
            f"{parts[0].param}: the model {ctx.model_name!r} takes no images (its checkpoint has no vision_config)",
            param=parts[0].param,
        )
    done: dict[str, Any] = {}
    out = []
    for p in parts:
        if p.url not in done:
            try:
                data = _b64(p) if p.raw_base64 else decode_data_url(p.url, where=p.param)
                done[p.url] = ctx.image_processor.process(data, name=p.param)
            except ValueError as e:
                message = str(e) if str(e).startswith(p.param) else f"{p.param}: {e}"
                raise RequestError(message, param=p.param) from None
        out.append(done[p.url])
    return out


def _b64(p: ImagePart) -> bytes:
    try:
        return base64.b64decode(p.url.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{p.param}: neither a data URL nor valid base64 ({e})") from None


def images_prompt_ids(ctx: ServerContext, row: dict[str, Any], images: list, key: str) -> list[int]:
    """The prompt ids of `row` ({"prompt": text} or {"messages": checked messages}) with each image's
    placeholder expanded to its XTML block; the pad runs checked against the images. Without images, the
    tokenizer's plain encoding. A 400 naming `key` for a placeholder count that does not match."""
    if not images:
        if "prompt" in row:
            return encode(ctx.tokenizer.encode, row["prompt"], key)
        return encode(ctx.tokenizer.encode_chat, row["messages"], key)
    texts = [row["prompt"]] if "prompt" in row else [m["content"] for m in row["messages"]]
    held = sum(t.count(IMAGE_PLACEHOLDER) for t in texts)
    if held != len(images):
        raise RequestError(
            f"{key} holds {held} image placeholder(s) {IMAGE_PLACEHOLDER} for {len(images)} "
            "image(s); in chat the image_url parts write them (text must not), in /generate the "
            "text holds one per image_data entry",
            param=key,
        )
    return encode(prompt_encoder(ctx.tokenizer, images, ctx.media_pad_id), row, key)
