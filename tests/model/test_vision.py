"""K3VisionModel (tower + projector) against a float64 reference written here from the published MoonViT3d /
PatchMergerMLPV2 formulas (no import of miles_k3.model.vision or miles_k3.ops.vision), images kept apart,
input errors named."""

import math

import pytest
import torch

from miles_k3.model import K3Config
from miles_k3.model.vision import K3VisionModel

CFG = K3Config.from_preset("k3-tiny-vl").vision_config  # D 64, 4 heads of 16, MLP 128, table 8 x 8, patch 14
# an image at the table's own size, one the table shrinks to, and a 2-frame video it stretches to
GRIDS = [(1, 8, 8), (1, 4, 6), (2, 6, 10)]


def _pixels(grids, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=g, dtype=torch.float64)


def _random_weights(seed=0):
    """Weights by checkpoint name, large enough that every nonlinearity matters; norms around 1."""
    g = torch.Generator().manual_seed(seed)
    d, m, inter, q = 64, 256, 128, 64
    w = {
        "vision_tower.patch_embed.proj.weight": torch.randn(d, 3, 14, 14, generator=g) * 0.05,
        "vision_tower.patch_embed.pos_emb.weight": torch.randn(8, 8, d, generator=g),
    }
    for i in range(2):
        b = f"vision_tower.encoder.blocks.{i}."
        w.update(
            {
                b + "norm0.weight": 1 + 0.2 * torch.randn(d, generator=g),
                b + "norm1.weight": 1 + 0.2 * torch.randn(d, generator=g),
                b + "wqkv.weight": torch.randn(3 * q, d, generator=g) * 0.3,
                b + "wo.weight": torch.randn(d, q, generator=g) * 0.15,
                b + "mlp.fc0.weight": torch.randn(inter, d, generator=g) * 0.2,
                b + "mlp.fc1.weight": torch.randn(d, inter, generator=g) * 0.1,
            }
        )
    w["vision_tower.encoder.final_layernorm.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    w.update(
        {
            "mm_projector.proj.0.weight": torch.randn(m, m, generator=g) * 0.1,
            "mm_projector.proj.2.weight": torch.randn(128, m, generator=g) * 0.1,
            "mm_projector.post_norm.weight": 1 + 0.2 * torch.randn(128, generator=g),
        }
    )
    return {k: v.double() for k, v in w.items()}


# ---------------------------------------------------------------- the float64 reference, from the formulas
def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _bilinear_matrix(n_out, n_in):
    """Rows of weights resampling n_in samples to n_out with half-pixel centres (source clamped at 0)."""
    a = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = int(math.floor(src))
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        a[i, i0] += 1 - lam
        a[i, i1] += lam
    return a


def _positions(table, t, h, w):
    spatial = torch.einsum("ia,jb,abd->ijd", _bilinear_matrix(h, 8), _bilinear_matrix(w, 8), table).reshape(h * w, -1)
    if t == 1:
        return spatial
    d = table.shape[-1]
    time = torch.zeros(t, d, dtype=torch.float64)
    for f in range(t):
        for i in range(d // 2):
            time[f, i] = math.sin(f * 10000 ** (-i / (d / 2)))
            time[f, d // 2 + i] = math.cos(f * 10000 ** (-i / (d / 2)))
    return torch.cat([spatial + time[f] for f in range(t)])


def _rotate(x, h, w):
    """x [t*h*w, heads, 16]: pair j turns by column (j even) or row (j odd) times 10000^(-4 (j // 2) / 16)."""
    out = x.clone()
    for n in range(x.shape[0]):
        row, col = divmod(n % (h * w), w)
        for j in range(8):
            angle = (col if j % 2 == 0 else row) * 10000 ** (-4 * (j // 2) / 16)
            a, b = x[n, :, 2 * j], x[n, :, 2 * j + 1]
            out[n, :, 2 * j] = a * math.cos(angle) - b * math.sin(angle)
            out[n, :, 2 * j + 1] = a * math.sin(angle) + b * math.cos(angle)
    return out


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _reference(w, pixels, grids):
    eps = torch.finfo(torch.float64).eps  # the released tower's nn.RMSNorm(dim): the dtype's epsilon
    x = torch.nn.functional.conv2d(pixels, w["vision_tower.patch_embed.proj.weight"], stride=14).flatten(1)
    x = x + torch.cat([_positions(w["vision_tower.patch_embed.pos_emb.weight"], *g) for g in grids])
    starts = [0]
    for t, h, ww in grids:
        starts.append(starts[-1] + t * h * ww)
    for i in range(2):
        b = f"vision_tower.encoder.blocks.{i}."
        qkv = _rms(x, w[b + "norm0.weight"], eps) @ w[b + "wqkv.weight"].T
        q, k, v = (qkv[:, j * 64 : (j + 1) * 64].reshape(-1, 4, 16) for j in range(3))
        attn = []
        for (t, h, ww), s, e in zip(grids, starts[:-1], starts[1:]):
            qi, ki, vi = _rotate(q[s:e], h, ww), _rotate(k[s:e], h, ww), v[s:e]
            scores = torch.einsum("nhd,mhd->hnm", qi, ki) / 4.0
            attn.append(torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vi).reshape(e - s, 64))
        x = x + torch.cat(attn) @ w[b + "wo.weight"].T
        hid = _gelu_tanh(_rms(x, w[b + "norm1.weight"], eps) @ w[b + "mlp.fc0.weight"].T)
        x = x + hid @ w[b + "mlp.fc1.weight"].T
    x = _rms(x, w["vision_tower.encoder.final_layernorm.weight"], eps)
    merged = []
    for (t, h, ww), s in zip(grids, starts):
        frames = x[s : s + t * h * ww].reshape(t, h, ww, -1).mean(0)
        for i in range(h // 2):
            for j in range(ww // 2):
                merged.append(torch.cat([frames[2 * i + a, 2 * j + c] for a in range(2) for c in range(2)]))
    m = torch.stack(merged) @ w["mm_projector.proj.0.weight"].T
    m = 0.5 * m * (1 + torch.erf(m / math.sqrt(2)))  # the projector's GELU is the exact one
    return _rms(m @ w["mm_projector.proj.2.weight"].T, w["mm_projector.post_norm.weight"], 1e-5)


def _model(weights=None):
    model = K3VisionModel(CFG).double().eval()
    model.load_state_dict(weights or _random_weights(), strict=True)
    return model


# ------------------------------------------------------------------------------------------------ tests
def test_tower_and_projector_equal_the_float64_reference_on_two_images_and_a_video():
    w = _random_weights()
    pixels = _pixels(GRIDS, seed=1)
    with torch.no_grad():
        got = _model(w).encode(pixels, torch.tensor(GRIDS))
    want = _reference(w, pixels, GRIDS)
    assert got.shape == (16 + 6 + 15, 128) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_num_tokens_counts_the_merged_grid_whatever_the_frames():
    assert _model().num_tokens(torch.tensor(GRIDS)) == [16, 6, 15]


def test_attention_never_crosses_images():
    model, grids = _model(), torch.tensor(GRIDS)
    pixels = _pixels(GRIDS, seed=2)
    other = pixels.clone()
    other[64:88] = _pixels([(1, 4, 6)], seed=3)  # image 2 only
    with torch.no_grad():
        a, b = model.encode(pixels, grids), model.encode(other, grids)
    assert torch.equal(a[:16], b[:16]) and torch.equal(a[22:], b[22:])
    assert not torch.allclose(a[16:22], b[16:22])


def test_an_image_encodes_alone_as_it_does_among_others():
    model = _model()
    pixels = _pixels(GRIDS, seed=4)
    with torch.no_grad():
        together = model.encode(pixels, torch.tensor(GRIDS))
        alone = model.encode(pixels[64:88], torch.tensor([GRIDS[1]]))
    torch.testing.assert_close(alone, together[16:22], rtol=0, atol=1e-13)


def test_state_dict_is_the_checkpoint_layout():
    shapes = CFG.tensor_shapes()
    state = K3VisionModel(CFG).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    assert K3Config.from_preset("k3").vision_config.num_parameters() == pytest.approx(0.45e9, rel=0.02)


def test_the_model_dtype_rules_the_computation():
    model = _model()
    pixels = _pixels(GRIDS[:2], seed=5)
    grids = torch.tensor(GRIDS[:2])
    with torch.no_grad():
        ref = model.encode(pixels, grids)
        fp32 = model.float().encode(pixels, grids)  # pixels are cast to the model's dtype
        bf16 = model.to(torch.bfloat16).encode(pixels, grids)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    torch.testing.assert_close(fp32.double(), ref, rtol=0, atol=1e-4)
    # bf16 keeps 2-3 digits, and its norms' eps is bf16's epsilon (as the released tower's): a few percent
    assert (bf16.double() - ref).norm() / ref.norm() < 0.05


@pytest.mark.parametrize(
    "grids, n, match",
    [
        ([(1, 5, 4)], 20, r"grid_thw\[0\]: 5 x 4 patches must be positive multiples of the merge kernel 2 x 2"),
        ([(1, 4, 4), (5, 2, 2)], 36, r"grid_thw\[1\]: t=5 frames, the tower takes 1..4"),
        ([(1, 4, 4)], 15, r"pixel_values has 15 patches, grid_thw says 16"),
    ],
)
def test_bad_inputs_fail_by_name(grids, n, match):
    with pytest.raises(ValueError, match=match):
        _model().encode(torch.zeros(n, 3, 14, 14, dtype=torch.float64), torch.tensor(grids))


def test_bad_shapes_fail_by_name():
    model = _model()
    with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3, 14, 14\]"):
        model.encode(torch.zeros(16, 3, 16, 16), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match=r"grid_thw must be an integer tensor \[n_images, 3\]"):
        model.encode(torch.zeros(16, 3, 14, 14), torch.tensor([4, 4]))


def test_every_table_is_made_on_the_model_device():
    """The meta device stands in for CUDA: a table made on the CPU would not mix with the meta weights."""
    with torch.device("meta"):
        model = K3VisionModel(CFG)
    out = model.encode(torch.zeros(64 + 48, 3, 14, 14), torch.tensor([[1, 8, 8], [2, 4, 6]]))
    assert out.device.type == "meta" and out.shape == (16 + 6, 128)


def test_the_interpolation_mode_is_the_configs():
    """bicubic (what some ports read the released tower as using) resizes differently; at the table's own
    size there is nothing to resize."""
    w = _random_weights()
    bicubic = K3VisionModel(CFG.replace(pos_emb_interpolation_mode="bicubic")).double().eval()
    bicubic.load_state_dict(w, strict=True)
    pixels = _pixels(GRIDS[:2], seed=6)
    with torch.no_grad():
        a, b = _model(w).encode(pixels, torch.tensor(GRIDS[:2])), bicubic.encode(pixels, torch.tensor(GRIDS[:2]))
    assert torch.equal(a[:16], b[:16]) and not torch.allclose(a[16:], b[16:])
