"""K3's image processor: an image becomes normalized 14x14 patches and a (1, h, w) patch grid.

The settings are the checkpoint's own (``preprocessor_config.json``'s ``media_proc_cfg``), never written
here: `ImageProcessorConfig.from_pretrained` reads them and checks every field by name. The transform is
the published one (the K3 checkpoint's ``KimiK3VisionProcessor``, mirrored by sglang and vLLM):

1. plan (pure arithmetic on the original W x H, `ImageProcessorConfig.plan`): scale =
   min(1, sqrt(in_patch_limit / (max(1, W // p) * max(1, H // p))), side * p / W, side * p / H), with
   ``side`` = patch_limit_on_one_side; the resized size is (max(1, int(W * scale)), max(1, int(H * scale))),
   each side capped at side * p; then each side is padded (right / bottom) up to a multiple of
   merge_kernel * p, so the patch grid is a multiple of the merge kernel;
2. PIL bicubic resize to the resized size, zero padding (black, before normalization), the transparent
   background composited before or after the resize as configured;
3. normalize: ``(x / 255 - mean) / std`` per channel (float32);
4. patchify row-major over the (h, w) patch grid: patch (i, j) is row ``i * w + j`` of
   ``pixel_values [h * w, 3, p, p]``.

The tower merges each kh x kw block of patches into one token, so an image takes ``h * w / (kh * kw)``
``<|media_pad|>`` tokens in the prompt (`miles_k3.data.media`). The XTML header names the ORIGINAL
upload size, not the resized one (the published processors build it from the image before the resize):
`ProcessedImage.size`.

Safe to call from any thread: an `ImageProcessor` holds only its frozen config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Union

import numpy as np
import torch

from miles_k3.model.checks import is_int as _is_int
from miles_k3.model.checks import is_number

PREPROCESSOR_CONFIG = "preprocessor_config.json"
FILL_STAGES = ("before_resize", "after_resize")
BACKGROUND_PATTERNS = ("chessboard", "white", "black", "gray")
_SOLID = {"white": 255, "black": 0, "gray": 128}
# media_proc_cfg keys the published file carries for video or bookkeeping: images never read them.
# Any other unknown key fails the load: a setting we do not implement could change the pixels.
IGNORED_KEYS = frozenset(
    {
        "in_patch_limit_each_frame",  # video: the per-frame patch budget
        "sample_fps",  # video: frames sampled per second
        "temporal_merge_kernel_size",  # video: frames merged per token
        "config_type",  # the publisher's class name for this block
    }
)

if TYPE_CHECKING:  # PIL is imported when an image is first processed, not with this module
    from PIL.Image import Image as PILImage
ImageInput = Union["PILImage", str, os.PathLike, bytes]


def _pil():
    try:
        from PIL import Image
    except ImportError:  # a dependency of the package; only a broken install lands here
        raise ImportError("the image processor needs Pillow (pip install pillow)") from None
    return Image


@dataclass(frozen=True)
class TransparentBackground:
    """What a transparent pixel is composited onto (``transparent_bg_config``)."""

    pattern: str  # "chessboard", or a solid "white" (255) / "black" (0) / "gray" (128)
    chessboard_square_size: int = 8  # chessboard: the side of one square, in pixels
    chessboard_square_on_top_left: bool = True  # chessboard: the top-left square is white (else gray)
    chessboard_white_value: int = 255  # chessboard: the light squares' value, all three channels
    chessboard_gray_value: int = 180  # chessboard: the dark squares' value, all three channels

    def validate(self) -> None:
        """ValueError naming the field (``transparent_bg_config.<field>``)."""

        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"transparent_bg_config.{name} {rule}, got {getattr(self, name)!r}")

        if self.pattern not in BACKGROUND_PATTERNS:
            raise fail("pattern", f"must be one of {BACKGROUND_PATTERNS}")
        if not _is_int(self.chessboard_square_size) or self.chessboard_square_size < 1:
            raise fail("chessboard_square_size", "must be an int >= 1")
        if not isinstance(self.chessboard_square_on_top_left, bool):
            raise fail("chessboard_square_on_top_left", "must be a bool")
        for name in ("chessboard_white_value", "chessboard_gray_value"):
            v = getattr(self, name)
            if not _is_int(v) or not 0 <= v <= 255:
                raise fail(name, "must be an int in [0, 255]")

    def canvas(self, width: int, height: int) -> np.ndarray:
        """The background, uint8 [height, width, 3]."""
        if self.pattern != "chessboard":
            return np.full((height, width, 3), _SOLID[self.pattern], dtype=np.uint8)
        s = self.chessboard_square_size
        parity = (np.arange(height)[:, None] // s + np.arange(width)[None, :] // s) % 2
        dark = parity == (1 if self.chessboard_square_on_top_left else 0)
        out = np.full((height, width, 3), self.chessboard_white_value, dtype=np.uint8)
        out[dark] = self.chessboard_gray_value
        return out


class ResizePlan(NamedTuple):
    """Where an image of a given size goes: the resized size, the padding, the grid and the token count."""

    width: int  # resized width, before padding
    height: int  # resized height, before padding
    pad_width: int  # black columns added on the right
    pad_height: int  # black rows added at the bottom
    grid_h: int  # patch rows: (height + pad_height) / patch_size
    grid_w: int  # patch columns
    num_tokens: int  # merged tokens: grid_h * grid_w / (kh * kw)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The checkpoint's image settings (``preprocessor_config.json`` -> ``media_proc_cfg``).

    The first six fields have no default: the checkpoint must say them. Validated on construction
    (ValueError starting with the field's name).
    """

    patch_size: int  # pixels on a patch side (K3: 14)
    # patches merged into one token, (rows, cols); the file writes an int (2 -> (2, 2)) or a pair
    merge_kernel_size: tuple[int, int]
    in_patch_limit: int  # the most patches an image may take before the resize shrinks it (K3: 65536)
    patch_limit_on_one_side: int  # the most patches along either side (K3: 512)
    image_mean: tuple[float, float, float]  # per-channel mean (RGB) subtracted after scaling to [0, 1]
    image_std: tuple[float, float, float]  # per-channel std (RGB) divided by after the mean
    # a fixed token count for every image; only None is supported (the tower's merged count is
    # h * w / (kh * kw), and a fixed count would not match it)
    fixed_output_tokens: int | None = None
    # transparent pixels are composited onto this; None: alpha is dropped (PIL's convert("RGB"))
    transparent_bg: TransparentBackground | None = None
    # composite before or after the bicubic resize ("after" keeps the background's edges crisp)
    transparent_bg_fill_stage: str = "before_resize"

    def __post_init__(self) -> None:
        if isinstance(self.merge_kernel_size, list):
            object.__setattr__(self, "merge_kernel_size", tuple(self.merge_kernel_size))
        elif _is_int(self.merge_kernel_size):
            object.__setattr__(self, "merge_kernel_size", (self.merge_kernel_size, self.merge_kernel_size))
        for name in ("image_mean", "image_std"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first bad field."""

        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        for name in ("patch_size", "in_patch_limit", "patch_limit_on_one_side"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise fail(name, "must be an int >= 1")
        mk = self.merge_kernel_size
        if not (isinstance(mk, tuple) and len(mk) == 2 and all(_is_int(k) and k >= 1 for k in mk)):
            raise fail("merge_kernel_size", "must be an int >= 1 or a pair of them")
        if any(self.patch_limit_on_one_side < k for k in mk):
            raise fail("patch_limit_on_one_side", f"must be at least the merge kernel {mk}")
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if not (isinstance(v, tuple) and len(v) == 3 and all(_is_number(x) for x in v)):
                raise fail(name, "must be three numbers (R, G, B)")
        if any(s <= 0 for s in self.image_std):
            raise fail("image_std", "must be > 0 in every channel")
        if self.fixed_output_tokens is not None:
            raise fail(
                "fixed_output_tokens",
                "is not supported (only null): the tower's merged token count is h * w / (kh * kw)",
            )
        if self.transparent_bg is not None:
            if not isinstance(self.transparent_bg, TransparentBackground):
                raise fail("transparent_bg", "must be a TransparentBackground or None")
            self.transparent_bg.validate()
        if self.transparent_bg_fill_stage not in FILL_STAGES:
            raise fail("transparent_bg_fill_stage", f"must be one of {FILL_STAGES}")

    @classmethod
    def from_media_proc_cfg(cls, cfg: dict[str, Any]) -> ImageProcessorConfig:
        """From the ``media_proc_cfg`` object. ValueError naming a missing, unknown or bad field."""
        if not isinstance(cfg, dict):
            raise ValueError(f"media_proc_cfg must be an object, got {type(cfg).__name__}")
        known = {f for f in cls.__dataclass_fields__ if f != "transparent_bg"} | {"transparent_bg_config"}
        unknown = sorted(set(cfg) - known - IGNORED_KEYS)
        if unknown:
            raise ValueError(
                f"media_proc_cfg.{unknown[0]}: not a setting this processor knows (known: "
                f"{sorted(known)}; ignored, video only: {sorted(IGNORED_KEYS)})"
            )
        required = [f for f, d in cls.__dataclass_fields__.items() if d.default is dataclasses.MISSING]
        missing = [f for f in required if f not in cfg]
        if missing:
            raise ValueError(f"media_proc_cfg.{missing[0]}: missing (required: {required})")
        kwargs = {k: v for k, v in cfg.items() if k in known and k != "transparent_bg_config"}
        bg = cfg.get("transparent_bg_config")
        if bg is not None:
            if not isinstance(bg, dict):
                raise ValueError(f"media_proc_cfg.transparent_bg_config must be an object or null, got {bg!r}")
            fields = set(TransparentBackground.__dataclass_fields__)
            extra = sorted(set(bg) - fields)
            if extra or "pattern" not in bg:
                what = f"unknown key {extra[0]!r}" if extra else "missing pattern"
                raise ValueError(f"media_proc_cfg.transparent_bg_config: {what} (keys: {sorted(fields)})")
            kwargs["transparent_bg"] = TransparentBackground(**bg)
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"media_proc_cfg.{e}") from None

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> ImageProcessorConfig:
        """Read ``<directory>/preprocessor_config.json``. One-line ValueError naming the file and the field
        (a missing file too)."""
        path = Path(directory) / PREPROCESSOR_CONFIG
        if not path.is_file():
            raise ValueError(f"{path}: not found (the checkpoint's image settings; an image model needs it)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict) or "media_proc_cfg" not in raw:
            raise ValueError(f"{path}: no media_proc_cfg object (the K3 processor's settings live there)")
        try:
            return cls.from_media_proc_cfg(raw["media_proc_cfg"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_media_proc_cfg(self) -> dict[str, Any]:
        """The ``media_proc_cfg`` object `from_media_proc_cfg` reads back to an equal config."""
        bg = self.transparent_bg
        return {
            "patch_size": self.patch_size,
            "merge_kernel_size": list(self.merge_kernel_size),
            "in_patch_limit": self.in_patch_limit,
            "patch_limit_on_one_side": self.patch_limit_on_one_side,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "fixed_output_tokens": self.fixed_output_tokens,
            "transparent_bg_config": None if bg is None else dict(bg.__dict__),
            "transparent_bg_fill_stage": self.transparent_bg_fill_stage,
        }

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``<directory>/preprocessor_config.json`` (the published layout); returns its path."""
        path = Path(directory) / PREPROCESSOR_CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"media_proc_cfg": self.to_media_proc_cfg()}, indent=2) + "\n", encoding="utf-8")
        return path

    def plan(self, width: int, height: int) -> ResizePlan:
        """The published resize rule for an image of ``width`` x ``height`` pixels (see the module doc)."""
        if not (_is_int(width) and _is_int(height) and width >= 1 and height >= 1):
            raise ValueError(f"image size must be two ints >= 1, got {width!r} x {height!r}")
        p, side = self.patch_size, self.patch_limit_on_one_side
        kh, kw = self.merge_kernel_size
        scale = min(
            1.0,
            math.sqrt(self.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
            side * p / width,
            side * p / height,
        )
        new_w = min(max(1, int(width * scale)), side * p)
        new_h = min(max(1, int(height * scale)), side * p)
        pad_w, pad_h = -new_w % (kw * p), -new_h % (kh * p)
        grid_h, grid_w = (new_h + pad_h) // p, (new_w + pad_w) // p
        if grid_h > side or grid_w > side:
            # Only reachable when side is not a multiple of the merge kernel: the padding crosses the cap.
            raise ValueError(
                f"patch_limit_on_one_side {side}: a {width}x{height} image pads to a "
                f"{grid_h}x{grid_w} patch grid, over it (make the limit a multiple of {kh}, {kw})"
            )
        return ResizePlan(new_w, new_h, pad_w, pad_h, grid_h, grid_w, grid_h * grid_w // (kh * kw))


@dataclass(frozen=True)
class ProcessedImage:
    """One image, ready for the tower. Frozen and shared (one per image, reused by every sample that sees it):
    treat ``pixel_values`` as read-only."""

    pixel_values: torch.Tensor = field(repr=False)  # float32 [h * w, 3, p, p], row-major over the patch grid
    grid_thw: tuple[int, int, int]  # (1, h, w) in patches (t = 1: one frame)
    num_tokens: int  # merged tokens, the number of <|media_pad|> it takes: h * w / (kh * kw)
    size: tuple[int, int]  # (W, H) the XTML header writes: the ORIGINAL upload size (published loaders)
    resized_size: tuple[int, int]  # (W, H) after the resize, before the padding
    # sha256 over the grid and the pixel_values' bytes: two images share it exactly when the tower sees the
    # same input, so the engine's prefix cache keys on it
    content_hash: bytes = field(repr=False)


class ImageProcessor:
    """Turns images into `ProcessedImage` by the checkpoint's settings."""

    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> ImageProcessor:
        return cls(ImageProcessorConfig.from_pretrained(directory))

    def num_tokens(self, width: int, height: int) -> int:
        """The <|media_pad|> count of a ``width`` x ``height`` image, without reading any pixels."""
        return self.config.plan(width, height).num_tokens

    def process(self, image: ImageInput, *, name: str | None = None) -> ProcessedImage:
        """A PIL image, a path, or the bytes of an image file (PNG, JPEG, ... as Pillow reads them).
        ``name`` labels the image in errors (default: the path, or ``image bytes``). A file that is missing or
        cannot be decoded is a one-line ValueError naming it."""
        img = open_image(image, name=name)
        c = self.config
        original = img.size
        plan = c.plan(*original)
        bg, fill_after = c.transparent_bg, c.transparent_bg_fill_stage == "after_resize"
        Image = _pil()
        if not fill_after:
            img = _flatten(img, bg)
        img = img.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
        if fill_after:
            img = _flatten(img, bg)
        pixels = np.asarray(img, dtype=np.uint8)
        if plan.pad_height or plan.pad_width:
            pixels = np.pad(pixels, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))
        x = pixels.astype(np.float32) / 255.0
        x -= np.asarray(c.image_mean, dtype=np.float64)
        x *= 1.0 / np.asarray(c.image_std, dtype=np.float64)
        p = c.patch_size
        # [H, W, C] -> [gh, p, gw, p, C] -> [gh, gw, C, p, p]: patch (i, j) at row i * gw + j.
        patches = x.reshape(plan.grid_h, p, plan.grid_w, p, 3).transpose(0, 2, 4, 1, 3)
        pixel_values = torch.from_numpy(np.ascontiguousarray(patches).reshape(-1, 3, p, p))
        grid = (1, plan.grid_h, plan.grid_w)
        return ProcessedImage(
            pixel_values=pixel_values,
            grid_thw=grid,
            num_tokens=plan.num_tokens,
            size=(int(original[0]), int(original[1])),
            resized_size=(plan.width, plan.height),
            content_hash=content_hash(pixel_values, grid),
        )


def content_hash(pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> bytes:
    """sha256 over a tag, the grid (three signed 8-byte big-endian ints) and the float32 pixel bytes."""
    h = hashlib.sha256(b"miles_k3.image.v1")
    for d in grid_thw:
        h.update(int(d).to_bytes(8, "big", signed=True))
    h.update(pixel_values.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.digest()


def open_image(image: ImageInput, *, name: str | None = None):
    """The decoded PIL image (fully loaded). One-line ValueError naming the file or ``name`` when the input is
    missing, not an image, truncated or corrupt."""
    Image = _pil()
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        label, src = name or f"image bytes ({len(image)} bytes)", io.BytesIO(bytes(image))
    elif isinstance(image, (str, os.PathLike)):
        label, src = name or os.fspath(image), os.fspath(image)
        if not os.path.isfile(src):
            raise ValueError(f"{label}: image file not found")
    else:
        raise ValueError(
            f"{name or 'image'}: must be a PIL image, a path or image-file bytes, got {type(image).__name__}"
        )
    try:
        img = Image.open(src)
        img.load()  # decode now: a truncated file fails here, named, not later inside the resize
    except Image.DecompressionBombError as e:
        raise ValueError(f"{label}: refused, too many pixels ({e})") from None
    except (OSError, ValueError, SyntaxError) as e:  # UnidentifiedImageError is an OSError
        raise ValueError(f"{label}: not a readable image ({type(e).__name__}: {e})") from None
    return img


def _flatten(img, bg: TransparentBackground | None):
    """RGB: alpha composited onto ``bg`` (None: dropped), other modes converted."""
    if img.mode == "RGB":
        return img
    has_alpha = "A" in img.getbands() or "transparency" in img.info
    if bg is None or not has_alpha:
        return img.convert("RGB")
    rgba = np.asarray(img.convert("RGBA"))
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    out = alpha * rgba[:, :, :3] + (1.0 - alpha) * bg.canvas(rgba.shape[1], rgba.shape[0])
    return _pil().fromarray(out.astype(np.uint8))


def _is_number(v: Any) -> bool:
    return is_number(v) and math.isfinite(v)
