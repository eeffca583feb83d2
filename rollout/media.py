"""Images in engine requests: a prompt's media pads, the features that replace their embeddings, and the keys
the prefix cache sees in their place.

A prompt carries its images in order; image i covers the next `num_tokens_i` of the prompt's
`media_placeholder_token_id` tokens (the pads), one projected feature row per pad. `MediaEncoder.place`
checks the count and the width at `submit` (ValueError, nothing queued), encodes the `ProcessedImage`s
through the engine's vision model and returns the request's `PromptMedia`.

Features are computed once per image content: the encoder keeps each image's features, on the engine's
device and dtype, for as long as some request holds them (a weak map keyed by content), so the n samples of
a GRPO prompt, submitted together, encode its images once and share one tensor.

Cache keys. The radix tree compares token ids, and every pad has the same id, so two prompts with the same
text and different images would share KV computed from the wrong image. The tree is therefore given the
prompt with each pad replaced by a key that only that image, at that offset inside it, has: a negative id
(no text token is negative) from the image's content hash. Different images part at their first pad; the
same image shares its whole span; a hit that ends inside an image restores the state after `k` of its pads,
and the prefill resumes the splice at row `k` (`PromptMedia.rows`). KDA checkpoints hang on the same
nodes, so they follow the keys. The keys never reach the model: the forward is fed the prompt's own ids.

What is safe when: a `PromptMedia` is immutable once built and lives on its `Request` (retraction
re-admits the request with the same media); `rows` and `keys` may be called at any time.
"""

from __future__ import annotations

import bisect
import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Union

import torch

from miles_k3.model.modeling import MediaEmbeds
from rollout.transfer import to_device

KEY_SPACE = 1 << 62  # image keys are -1 - ((base + offset) mod KEY_SPACE): negative, 62 bits of hash


@dataclass(frozen=True)
class ImageFeatures:
    """An image given by its projected features [num_tokens, hidden_size] (computed by the caller) and a hash
    of its content: equal hashes claim equal features (the prefix cache shares them)."""

    features: torch.Tensor
    content_hash: Any


class ProcessedImageLike(Protocol):
    """`miles_k3.data.image_processor.ProcessedImage`'s fields the engine reads."""

    pixel_values: torch.Tensor  # [N patches, 3, p, p]
    grid_thw: tuple[int, int, int] | torch.Tensor  # (t, h, w) patches, or a [1, 3] tensor
    num_tokens: int
    content_hash: Any


Image = Union[ImageFeatures, ProcessedImageLike]


def key_base(content_hash: Any, num_tokens: int) -> int:
    """An image's cache-key base: a 62-bit digest of its content hash and token count."""
    raw = content_hash if isinstance(content_hash, bytes) else f"{type(content_hash).__name__}:{content_hash}".encode()
    digest = hashlib.blake2b(raw + b"|" + str(num_tokens).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % KEY_SPACE


def image_keys(base: int, num_tokens: int) -> list[int]:
    """The keys of an image's pads, in order: negative, distinct, and shared only by the same content."""
    return [-1 - (base + k) % KEY_SPACE for k in range(num_tokens)]


class PromptMedia:
    """A prompt's images placed on its pads. `pads`: the prompt positions of the pad tokens, ascending;
    `images`: per image (features [n_i, D] on the engine's device, key base), in prompt order, covering
    the pads in order. `prompt_keys`: the prompt as the radix tree sees it."""

    def __init__(self, prompt_ids: list[int], pads: list[int], images: list[tuple[torch.Tensor, int]]):
        self.pads = pads
        self.images = images
        self.starts = [0]  # row of the first pad of each image in the prompt's feature rows
        for features, _ in images:
            self.starts.append(self.starts[-1] + features.shape[0])
        keys = list(prompt_ids)
        for (features, base), start in zip(images, self.starts):
            for pos, key in zip(pads[start : start + features.shape[0]], image_keys(base, features.shape[0])):
                keys[pos] = key
        self.prompt_keys = keys

    def keys(self, tokens: list[int]) -> list[int]:
        """`tokens` (the prompt, then outputs) with the prompt's pads replaced by their image keys. Outputs
        are text even when one is the pad id: only the prompt's pads carry features."""
        return self.prompt_keys + tokens[len(self.prompt_keys) :]

    def rows(self, start: int, end: int) -> tuple[list[int], torch.Tensor | None]:
        """The pads in prompt positions [start, end) and their feature rows [n, D] (None when there are none)."""
        i, j = bisect.bisect_left(self.pads, start), bisect.bisect_left(self.pads, end)
        if i == j:
            return [], None
        pieces = []
        for (features, _), lo in zip(self.images, self.starts):
            a, b = max(i, lo), min(j, lo + features.shape[0])
            if a < b:
                pieces.append(features[a - lo : b - lo])
        return self.pads[i:j], pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def packed_media(chunks: list[tuple[Any, int, int]], device: torch.device) -> MediaEmbeds | None:
    """The `MediaEmbeds` of one packed prefill row: `chunks` are (PromptMedia or None, start, end) per
    request, in row order, each bringing prompt positions [start, end). None when no chunk covers a pad."""
    positions: list[int] = []
    rows: list[torch.Tensor] = []
    offset = 0
    for media, start, end in chunks:
        if media is not None:
            pads, feats = media.rows(start, end)
            if feats is not None:
                positions.extend(offset + p - start for p in pads)
                rows.append(feats)
        offset += end - start
    if not rows:
        return None
    return MediaEmbeds(to_device(positions, device, torch.long), rows[0] if len(rows) == 1 else torch.cat(rows))


class MediaEncoder:
    """Turns a request's images into its `PromptMedia`: checks them, encodes `ProcessedImage`s with the
    vision model (`K3VisionModel.encode(pixel_values, grid_thw)`, None: the engine takes features only) and
    keeps one features tensor per image content while a request holds it."""

    def __init__(
        self,
        vision: torch.nn.Module | None,
        pad_id: int | None,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.vision, self.pad_id, self.hidden_size = vision, pad_id, hidden_size
        self.device, self.dtype = device, dtype
        # key base -> features on the engine's device: an entry lives exactly as long as a request holds it
        self._features: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.encoded_images = 0  # images run through the vision model (cached features skip it)

    def place(self, prompt_ids: list[int], images: list[Image] | None) -> PromptMedia | None:
        """The prompt's media (None for a text prompt: no images and no pads), or a one-line ValueError naming
        what is wrong (nothing is encoded then)."""
        images = list(images or [])
        if not images and (self.pad_id is None or self.pad_id not in prompt_ids):
            return None
        if self.pad_id is None:
            raise ValueError(
                "images given, but this engine has no media_token_id (pass Engine(media_token_id=...) "
                "or a config with media_placeholder_token_id)"
            )
        counts = []
        for i, image in enumerate(images):
            if isinstance(image, ImageFeatures):
                f = image.features
                if not (
                    torch.is_tensor(f) and f.dim() == 2 and f.shape[1] == self.hidden_size and f.is_floating_point()
                ):
                    shape = tuple(f.shape) if torch.is_tensor(f) else type(f).__name__
                    raise ValueError(
                        f"images[{i}].features must be a float [num_tokens, {self.hidden_size}] tensor "
                        f"(hidden_size), got {shape}"
                    )
                counts.append(f.shape[0])
            elif all(hasattr(image, a) for a in ("pixel_values", "grid_thw", "num_tokens", "content_hash")):
                if self.vision is None:
                    raise ValueError(
                        f"images[{i}] is a ProcessedImage but this engine has no vision model "
                        "(pass Engine(vision=...), or give ImageFeatures)"
                    )
                counts.append(int(image.num_tokens))
            else:
                raise ValueError(
                    f"images[{i}] must be an ImageFeatures or a ProcessedImage, got {type(image).__name__}"
                )
        pads = self.pads(prompt_ids)
        if len(pads) != sum(counts):
            raise ValueError(
                f"the prompt has {len(pads)} media pad tokens (id {self.pad_id}) but its "
                f"{len(images)} image(s) have {sum(counts)} feature rows ({counts})"
            )
        if pads and pads[-1] == len(prompt_ids) - 1:
            raise ValueError("the prompt ends on a media pad token: an image's pads are followed by its end token")
        bases = [key_base(image.content_hash, n) for image, n in zip(images, counts)]
        return PromptMedia(prompt_ids, pads, list(zip(self._features_of(images, bases), bases)))

    @property
    def held_images(self) -> int:
        """Images whose features some request (or caller) still holds."""
        return len(self._features)

    def pads(self, prompt_ids: list[int]) -> list[int]:
        """The positions of the prompt's media pad tokens, ascending."""
        return [p for p, t in enumerate(prompt_ids) if t == self.pad_id]

    def _features_of(self, images: list[Image], bases: list[int]) -> list[torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        to_encode = []
        for image, base in zip(images, bases):
            if base in out:
                continue
            if (cached := self._features.get(base)) is not None:
                out[base] = cached
            elif isinstance(image, ImageFeatures):
                out[base] = image.features.detach().to(self.device, self.dtype)
            else:
                to_encode.append((image, base))
                out[base] = None  # placeholder: a repeat of this image in the prompt encodes once
        if to_encode:
            self._encode(to_encode, out)
        for base, features in out.items():
            self._features[base] = features
        return [out[base] for base in bases]

    @torch.inference_mode()
    def _encode(self, todo: list[tuple[Any, int]], out: dict[int, torch.Tensor]) -> None:
        """One vision forward over the prompt's new images; its rows split back per image."""
        pixels = torch.cat([image.pixel_values for image, _ in todo])  # the vision model moves them to its device
        grids = torch.cat([torch.as_tensor(image.grid_thw).reshape(-1, 3) for image, _ in todo])
        feats = self.vision.encode(pixels, grids)
        counts = [int(image.num_tokens) for image, _ in todo]
        if tuple(feats.shape) != (sum(counts), self.hidden_size):
            raise ValueError(
                f"the vision model returned features {tuple(feats.shape)}, expected "
                f"[{sum(counts)}, {self.hidden_size}] (the images' num_tokens, hidden_size)"
            )
        for (_, base), rows in zip(todo, feats.to(self.device, self.dtype).split(counts)):
            out[base] = rows.clone()  # its own storage, not a view of the batch's
        self.encoded_images += len(todo)
