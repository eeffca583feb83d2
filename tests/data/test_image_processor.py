"""The image processor: the published resize rule on hand-worked sizes, normalization, row-major patches,
the content hash, transparency, and every way a config or an image file can be bad."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from miles_k3.data.image_processor import (
    PREPROCESSOR_CONFIG,
    ImageProcessor,
    ImageProcessorConfig,
    TransparentBackground,
    content_hash,
)

# The published K3 checkpoint's media_proc_cfg (preprocessor_config.json), keys as it writes them.
K3_MEDIA_PROC_CFG = {
    "in_patch_limit": 65536,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 16384,
    "sample_fps": 8.0,
    "temporal_merge_kernel_size": 4,
    "transparent_bg_config": {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255,
        "chessboard_gray_value": 180,
    },
    "transparent_bg_fill_stage": "after_resize",
    "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
}
K3 = ImageProcessorConfig.from_media_proc_cfg(K3_MEDIA_PROC_CFG)


def small(**kw):
    base = dict(
        patch_size=14,
        merge_kernel_size=2,
        in_patch_limit=16,
        patch_limit_on_one_side=512,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    )
    return ImageProcessorConfig(**{**base, **kw})


def png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# --- the resize rule, by hand ---


def test_sides_not_multiples_of_the_patch_are_padded_to_the_merge_grid():
    # 225x223: 16 x 15 = 240 patches, far under 65536; one side cap 512 * 14 = 7168: scale 1, no resize.
    # Pad to multiples of 2 * 14 = 28: 225 = 8 * 28 + 1 -> +27 = 252; 223 = 7 * 28 + 27 -> +1 = 224.
    # Grid 224 / 14 = 16 rows, 252 / 14 = 18 columns: 288 patches, 288 / 4 = 72 tokens.
    p = K3.plan(225, 223)
    assert (p.width, p.height, p.pad_width, p.pad_height) == (225, 223, 27, 1)
    assert (p.grid_h, p.grid_w, p.num_tokens) == (16, 18, 72)
    out = ImageProcessor(K3).process(Image.new("RGB", (225, 223), (9, 9, 9)))
    assert out.pixel_values.shape == (288, 3, 14, 14) and out.pixel_values.dtype == torch.float32
    assert out.grid_thw == (1, 16, 18) and out.num_tokens == 72
    assert out.size == (225, 223) and out.resized_size == (225, 223)


def test_a_large_photo_under_the_k3_patch_budget_keeps_its_size():
    # 4000x3000: 285 * 214 = 60990 patches <= 65536, 4000 < 7168: scale 1. Pad 4000 = 142 * 28 + 24 -> +4,
    # 3000 = 107 * 28 + 4 -> +24: grid 3024 / 14 = 216 by 4004 / 14 = 286, tokens 108 * 143 = 15444.
    assert tuple(K3.plan(4000, 3000)) == (4000, 3000, 4, 24, 216, 286, 15444)


def test_an_image_over_the_patch_cap_shrinks_to_it():
    # in_patch_limit 16; 112x112 is 8 * 8 = 64 patches: scale sqrt(16 / 64) = 0.5 -> 56x56, a multiple of
    # 28 already: grid 4x4 = 16 patches (the cap), 16 / 4 = 4 tokens. The header keeps the original size.
    c = small()
    assert tuple(c.plan(112, 112)) == (56, 56, 0, 0, 4, 4, 4)
    out = ImageProcessor(c).process(Image.new("RGB", (112, 112), (200, 10, 10)))
    assert out.size == (112, 112) and out.resized_size == (56, 56) and out.grid_thw == (1, 4, 4)
    # 100x30 over the cap: 7 * 2 = 14 patches <= 16, scale 1; pad 100 -> 112, 30 -> 56: grid 4x8, 8 tokens.
    assert tuple(c.plan(100, 30)) == (100, 30, 12, 26, 4, 8, 8)


def test_the_one_side_cap():
    # patch_limit_on_one_side 16: a side may be at most 16 * 14 = 224 px. 1000x100: scale 224 / 1000 = 0.224
    # -> 224 x int(22.4) = 22; pad 22 -> 28: grid 2 x 16, tokens 1 * 8 = 8.
    c = small(in_patch_limit=65536, patch_limit_on_one_side=16)
    assert tuple(c.plan(1000, 100)) == (224, 22, 0, 6, 2, 16, 8)
    # A tiny image is never enlarged: 5x3 -> pad to 28x28, one merged token.
    assert tuple(c.plan(5, 3)) == (5, 3, 23, 25, 2, 2, 1)


def test_a_non_square_merge_kernel():
    # merge (1, 2): rows pad to 14, columns to 28. 30x20 -> 56 x 28: grid 2 x 4, 8 / 2 = 4 tokens.
    assert tuple(small(merge_kernel_size=[1, 2], in_patch_limit=65536).plan(30, 20)) == (30, 20, 26, 8, 2, 4, 4)


# --- pixels ---


def test_constant_colour_normalizes_per_channel_and_padding_is_normalized_black():
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    c = small(image_mean=mean, image_std=std, in_patch_limit=65536)
    out = ImageProcessor(c).process(Image.new("RGB", (28, 20), (255, 0, 51)))  # pads 20 -> 28 rows
    want = torch.tensor([(v / 255 - m) / s for v, m, s in zip((255, 0, 51), mean, std)], dtype=torch.float32)
    pad = torch.tensor([(0 - m) / s for m, s in zip(mean, std)], dtype=torch.float32)
    img = out.pixel_values  # grid 2 x 2: patches 0, 1 on top (image rows 0-13), 2, 3 below (rows 14-27)
    assert torch.allclose(img[0], want[:, None, None].expand(3, 14, 14), atol=1e-6)
    assert torch.allclose(img[2][:, :6], want[:, None, None].expand(3, 6, 14), atol=1e-6)  # image rows 14-19
    assert torch.allclose(img[2][:, 6:], pad[:, None, None].expand(3, 8, 14), atol=1e-6)  # padded rows 20-27
    # mean = std = 0.5 maps [0, 255] onto [-1, 1] exactly.
    k3 = ImageProcessor(K3).process(Image.new("RGB", (28, 28), (255, 0, 255))).pixel_values
    assert torch.equal(k3[0, :, 0, 0], torch.tensor([1.0, -1.0, 1.0]))


def test_patches_are_row_major_over_the_grid_and_channel_first_inside():
    # 56 x 28 (W x H): no resize, grid 2 rows x 4 columns. Red = the patch's index, green = y in the patch,
    # blue = x in the patch; mean 0, std 1 leaves x / 255.
    arr = np.zeros((28, 56, 3), dtype=np.uint8)
    for y in range(28):
        for x in range(56):
            arr[y, x] = ((y // 14) * 4 + x // 14, y % 14, x % 14)
    c = small(in_patch_limit=65536, image_mean=(0, 0, 0), image_std=(1, 1, 1))
    pv = ImageProcessor(c).process(Image.fromarray(arr)).pixel_values * 255
    assert pv.shape == (8, 3, 14, 14)
    for r in range(8):
        assert torch.allclose(pv[r, 0], torch.full((14, 14), float(r)), atol=1e-4)
    ramp = torch.arange(14, dtype=torch.float32)
    assert torch.allclose(pv[5, 1], ramp[:, None].expand(14, 14), atol=1e-4)  # green varies down the rows
    assert torch.allclose(pv[5, 2], ramp[None, :].expand(14, 14), atol=1e-4)  # blue across the columns


def test_the_resize_is_pil_bicubic_to_the_planned_size():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8))
    c = small(image_mean=(0, 0, 0), image_std=(1, 1, 1))
    want = np.asarray(img.resize((56, 56), resample=Image.Resampling.BICUBIC), dtype=np.float32) / 255
    got = ImageProcessor(c).process(img).pixel_values  # [16, 3, 14, 14] -> back to [56, 56, 3]
    back = got.reshape(4, 4, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(56, 56, 3)
    assert torch.allclose(back, torch.from_numpy(want), atol=1e-6)


def test_inputs_pil_path_and_bytes_agree_and_the_hash_tracks_the_pixels(tmp_path):
    img = Image.new("RGB", (30, 30), (1, 2, 3))
    data = png_bytes(img)
    (tmp_path / "a.png").write_bytes(data)
    proc = ImageProcessor(K3)
    path = tmp_path / "a.png"
    outs = [proc.process(img), proc.process(data), proc.process(path), proc.process(str(path))]
    assert len({o.content_hash for o in outs}) == 1 and len(outs[0].content_hash) == 32
    assert all(torch.equal(o.pixel_values, outs[0].pixel_values) for o in outs)
    other = proc.process(Image.new("RGB", (30, 30), (1, 2, 4)))
    assert other.content_hash != outs[0].content_hash
    # The same pixels on another grid are another image.
    pv = outs[0].pixel_values
    assert content_hash(pv, (1, 2, 2)) != content_hash(pv, (1, 1, 4))


def test_transparency_composites_onto_the_configured_background():
    clear = Image.new("RGBA", (28, 28), (10, 20, 30, 0))
    flat = ImageProcessor(K3).process(clear).pixel_values  # K3: chessboard of 8 px, white top-left, after resize
    px = ((flat.reshape(2, 2, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 28, 3) + 1) / 2 * 255).round()
    assert px[0, 0].tolist() == [255, 255, 255] and px[0, 8].tolist() == [180, 180, 180]
    assert px[8, 8].tolist() == [255, 255, 255] and px[8, 0].tolist() == [180, 180, 180]
    # No background configured: the alpha channel is dropped.
    dropped = ImageProcessor(small(in_patch_limit=65536)).process(clear).pixel_values
    assert torch.allclose((dropped[0, :, 0, 0] + 1) / 2 * 255, torch.tensor([10.0, 20.0, 30.0]), atol=1e-4)
    assert TransparentBackground("black").canvas(2, 1).tolist() == [[[0, 0, 0], [0, 0, 0]]]


# --- bad images ---


def test_a_corrupt_or_missing_image_fails_in_one_line_naming_it(tmp_path):
    proc = ImageProcessor(K3)
    with pytest.raises(ValueError, match=r"^image bytes \(12 bytes\): not a readable image") as e:
        proc.process(b"not an image")
    assert "\n" not in str(e.value)
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(png_bytes(Image.new("RGB", (64, 64), (5, 6, 7)))[:60])
    with pytest.raises(ValueError, match=r"cut\.png: not a readable image") as e:
        proc.process(truncated)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"nope\.png: image file not found"):
        proc.process(tmp_path / "nope.png")
    with pytest.raises(ValueError, match=r"^row 3: not a readable image"):
        proc.process(b"\x89PNG\r\n\x1a\n garbage", name="row 3")
    with pytest.raises(ValueError, match="must be a PIL image, a path or image-file bytes, got int"):
        proc.process(3)


def test_jpeg_and_palette_images_process_to_rgb():
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (250, 5, 5)).save(buf, format="JPEG", quality=95)
    out = ImageProcessor(K3).process(buf.getvalue())
    assert out.grid_thw == (1, 4, 4) and out.size == (40, 30)
    assert abs(float(out.pixel_values[0, 0, 0, 0]) - (250 / 255 * 2 - 1)) < 0.05  # lossy, close to red
    pal = Image.new("P", (28, 28), 0)
    pal.putpalette([0, 200, 0] + [0] * 765)
    assert torch.allclose(
        ImageProcessor(K3).process(pal).pixel_values[0, :, 0, 0],
        torch.tensor([-1.0, 200 / 255 * 2 - 1, -1.0]),
        atol=1e-6,
    )


# --- the config file ---


def test_from_pretrained_reads_the_published_file_and_round_trips(tmp_path):
    (tmp_path / PREPROCESSOR_CONFIG).write_text(
        json.dumps({"media_proc_cfg": K3_MEDIA_PROC_CFG, "processor_class": "KimiK3Processor"})
    )
    c = ImageProcessorConfig.from_pretrained(tmp_path)
    assert c == K3 and c.merge_kernel_size == (2, 2) and c.transparent_bg.chessboard_gray_value == 180
    assert ImageProcessor.from_pretrained(tmp_path).num_tokens(225, 223) == 72
    c.save_pretrained(tmp_path / "copy")
    assert ImageProcessorConfig.from_pretrained(tmp_path / "copy") == c


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.pop("patch_size"), r"media_proc_cfg\.patch_size: missing"),
        (lambda d: d.update(patch_size="14"), r"media_proc_cfg\.patch_size must be an int >= 1, got '14'"),
        (lambda d: d.update(merge_kernel_size=[2, 0]), r"media_proc_cfg\.merge_kernel_size must be"),
        (lambda d: d.update(image_std=[0.5, 0, 0.5]), r"media_proc_cfg\.image_std must be > 0"),
        (lambda d: d.update(image_mean=[0.5, 0.5]), r"media_proc_cfg\.image_mean must be three numbers"),
        (lambda d: d.update(fixed_output_tokens=64), r"media_proc_cfg\.fixed_output_tokens is not supported"),
        (lambda d: d.update(transparent_bg_fill_stage="later"), r"transparent_bg_fill_stage must be one of"),
        (lambda d: d.update(resize_mode="crop"), r"media_proc_cfg\.resize_mode: not a setting this processor knows"),
        (lambda d: d["transparent_bg_config"].update(pattern="stripes"), r"transparent_bg_config\.pattern must be"),
        (lambda d: d["transparent_bg_config"].update(tint=1), r"transparent_bg_config: unknown key 'tint'"),
    ],
)
def test_a_bad_field_fails_by_name_in_one_line(tmp_path, edit, match):
    cfg = json.loads(json.dumps(K3_MEDIA_PROC_CFG))
    edit(cfg)
    (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps({"media_proc_cfg": cfg}))
    with pytest.raises(ValueError, match=match) as e:
        ImageProcessorConfig.from_pretrained(tmp_path)
    assert str(e.value).startswith(str(tmp_path / PREPROCESSOR_CONFIG)) and "\n" not in str(e.value)


def test_a_missing_or_malformed_file_fails_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: not found"):
        ImageProcessorConfig.from_pretrained(tmp_path)
    (tmp_path / PREPROCESSOR_CONFIG).write_text("{not json")
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: not valid JSON"):
        ImageProcessorConfig.from_pretrained(tmp_path)
    (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: no media_proc_cfg object"):
        ImageProcessorConfig.from_pretrained(tmp_path)


def test_a_patch_side_limit_the_padding_crosses_is_refused():
    # side 3 with a 2x2 kernel: a 42x42 image (3 x 3 patches) pads to 4 x 4, over the limit.
    with pytest.raises(ValueError, match=r"patch_limit_on_one_side 3: a 42x42 image pads to a 4x4 patch grid"):
        small(patch_limit_on_one_side=3, in_patch_limit=65536).plan(42, 42)
