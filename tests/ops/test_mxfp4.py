"""Tests for miles_k3.ops.mxfp4 (CPU, seeded, fast)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from miles_k3.ops.mxfp4 import (
    FP4_E2M1_VALUES,
    MXFP4Weight,
    dequantize_mxfp4,
    mxfp4_roundtrip_error_bound,
    quantize_mxfp4,
)

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _block(values: list[float], fill: float = 0.0) -> torch.Tensor:
    """One 32-element fp32 block: ``values`` followed by ``fill``."""
    assert len(values) <= 32
    return torch.tensor(values + [fill] * (32 - len(values)), dtype=torch.float32)


def _codes(packed: torch.Tensor) -> list[int]:
    """Unpack a 1-D packed tensor by hand: low nibble first."""
    out = []
    for b in packed.tolist():
        out.append(b & 0xF)
        out.append(b >> 4)
    return out


def _roundtrip(w: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    p, s = quantize_mxfp4(w)
    return dequantize_mxfp4(p, s, dtype)


# ---------------------------------------------------------------- naive reference


def _ref_quantize_block(block: list[float]) -> tuple[int, list[int]]:
    """Deliberately naive scalar MXFP4 of one block: (scale byte, codes)."""
    amax = max(abs(x) for x in block)
    if amax == 0.0:
        e = -127
    else:
        # Find e with 2**(e+2) <= amax < 2**(e+3) by walking, no log2/frexp.
        e = 0
        while 2.0 ** (e + 2) > amax:
            e -= 1
        while 2.0 ** (e + 3) <= amax:
            e += 1
        e = max(-127, min(127, e))
    codes = []
    for x in block:
        a = abs(x) / 2.0**e  # exact in double for fp32 inputs
        best = 0
        for i, m in enumerate(MAGS):
            d, db = abs(a - m), abs(a - MAGS[best])
            if d < db or (d == db and i % 2 == 0 and best % 2 == 1):
                best = i
        sign = 1 if math.copysign(1.0, x) < 0 else 0
        codes.append(sign << 3 | best)
    return e + 127, codes


# ---------------------------------------------------------------- format details


def test_code_table():
    vals = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    assert vals.shape == (16,)
    for c in range(16):
        expected = (-1.0 if c >= 8 else 1.0) * MAGS[c & 7]
        assert vals[c].item() == expected
        assert bool(torch.signbit(vals[c])) == (c >= 8)


def test_known_values_amax6_scale127_exact_codes():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    w = _block(grid, fill=1.0)
    p, s = quantize_mxfp4(w)
    assert p.dtype == torch.uint8 and s.dtype == torch.uint8
    assert p.shape == (16,) and s.shape == (1,)
    assert s.tolist() == [127]
    expected = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15] + [2] * 17
    assert _codes(p) == expected
    assert torch.equal(dequantize_mxfp4(p, s, torch.float32), w)


def test_nibble_order_hand_computed_bytes():
    # e0=0.5 (code 1), e1=6 (code 7), e2=-1 (code 0xA), e3=0 (code 0),
    # e30=3 (code 5), e31=-4 (code 0xE); amax 6 -> scale byte 127.
    vals = [0.0] * 32
    vals[0], vals[1], vals[2], vals[30], vals[31] = 0.5, 6.0, -1.0, 3.0, -4.0
    p, s = quantize_mxfp4(torch.tensor(vals))
    assert s.tolist() == [127]
    expected = [0] * 16
    expected[0] = 0x71  # low nibble = element 0, high nibble = element 1
    expected[1] = 0x0A
    expected[15] = 0xE5
    assert p.tolist() == expected


def test_amax12_gives_scale128():
    w = _block([12.0, 1.0, 3.0, 5.0, -12.0])
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [128]  # floor(log2 12) - 2 = 1
    # Scaled by 1/2: 6 -> 7, 0.5 -> 1, 1.5 -> 3, 2.5 ties to 2 (code 4), -6 -> 15.
    assert _codes(p)[:5] == [7, 1, 3, 4, 15]
    assert dequantize_mxfp4(p, s, torch.float32)[:5].tolist() == [12.0, 1.0, 3.0, 4.0, -12.0]


@pytest.mark.parametrize(
    "amax,byte",
    [(4.0, 127), (7.99, 127), (8.0, 128), (0.5, 124), (2.0**100, 225), (2.0**-120, 5), (3e38, 252)],
)
def test_scale_exponent_rule(amax, byte):
    _, s = quantize_mxfp4(_block([amax, -amax / 3]))
    assert s.tolist() == [byte]


def test_tiny_and_zero_blocks_clamp_to_byte0():
    # amax = 2**-140 would want e = -142; clamped to -127 (byte 0), where the
    # scaled values are ~2**-13 and round to (signed) zero.
    w = torch.cat([_block([2.0**-140, -(2.0**-141)]), torch.zeros(32)])
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [0, 0]
    assert _codes(p)[:2] == [0, 8]
    assert set(_codes(p)[2:]) == {0}
    # Byte 0 decodes to the subnormal 2**-127 exactly.
    vals = [0.0] * 32
    vals[0] = 6.0 * 2.0**-127
    p2, s2 = quantize_mxfp4(torch.tensor(vals))
    assert s2.tolist() == [0] and _codes(p2)[0] == 7
    assert dequantize_mxfp4(p2, s2, torch.float32)[0].item() == 6.0 * 2.0**-127


def test_negative_zero():
    w = _block([-0.0, 0.0, -0.1, 0.1, 6.0])
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [127]
    assert _codes(p)[:5] == [8, 0, 8, 0, 7]
    dq = dequantize_mxfp4(p, s, torch.float32)
    assert dq[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.signbit(dq[:4]).tolist() == [True, False, True, False]

    pz, sz = quantize_mxfp4(torch.full((32,), -0.0))
    assert sz.tolist() == [0]
    assert pz.tolist() == [0x88] * 16
    assert torch.signbit(dequantize_mxfp4(pz, sz, torch.float32)).all()


def test_ties_round_half_to_even_code_index():
    # 6.0 pins the scale to 2**0. Each tie goes to the even code index.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    expected_codes = [0, 2, 2, 4, 4, 6, 6]
    w = _block([6.0] + ties + [-t for t in ties])
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [127]
    codes = _codes(p)
    assert codes[1:8] == expected_codes
    assert codes[8:15] == [8 | c for c in expected_codes]
    dq = dequantize_mxfp4(p, s, torch.float32)
    assert dq[1:8].tolist() == expected
    assert dq[8:15].tolist() == [-v for v in expected]


def test_just_off_ties_round_to_nearest():
    # One fp32 ulp past a tie decides it regardless of the tie rule.
    t_up = torch.tensor([0.25, 1.25, 2.5, 5.0])
    t_down = torch.tensor([0.75, 1.75, 3.5])
    above = torch.nextafter(t_up, torch.full_like(t_up, 10.0))
    below = torch.nextafter(t_down, torch.zeros_like(t_down))
    w = torch.cat([torch.tensor([6.0]), above, below, torch.zeros(24)])
    dq = _roundtrip(w)
    assert dq[1:5].tolist() == [0.5, 1.5, 3.0, 6.0]
    assert dq[5:8].tolist() == [0.5, 1.5, 3.0]


def test_saturation_clamps_to_6_scaled():
    w = _block([7.5, 6.5, 7.0, -7.99, 5.5, 1.0])
    p, s = quantize_mxfp4(w)
    assert s.tolist() == [127]  # floor(log2 7.99) - 2 = 0
    dq = dequantize_mxfp4(p, s, torch.float32)
    assert dq[:6].tolist() == [6.0, 6.0, 6.0, -6.0, 6.0, 1.0]
    bound = mxfp4_roundtrip_error_bound(w)
    # Saturated entries: bound is the exact clamp error; others: 2**e = 1.
    assert bound[:6].tolist() == pytest.approx([1.5, 1.0, 1.0, 1.99, 1.0, 1.0])
    assert ((w - dq).abs() <= bound).all()


# ---------------------------------------------------------------- round trips


def test_roundtrip_exact_on_scaled_grid():
    g = torch.Generator().manual_seed(0)
    rows, blocks = 16, 8
    table = torch.tensor(FP4_E2M1_VALUES)
    codes = torch.randint(0, 16, (rows, blocks, 32), generator=g)
    # Force a magnitude in the top binade so the quantizer re-derives the
    # same exponent, which makes the packed bytes reproduce exactly too.
    codes[..., 0] = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (rows, blocks), generator=g)]
    exps = torch.randint(-126, 126, (rows, blocks, 1), generator=g)
    w = table[codes] * torch.pow(2.0, exps.double()).float()
    w = w.reshape(rows, blocks * 32)
    p, s = quantize_mxfp4(w)
    assert torch.equal(s.reshape(rows, blocks), (exps.squeeze(-1) + 127).to(torch.uint8))
    dq = dequantize_mxfp4(p, s, torch.float32)
    assert torch.equal(dq, w)
    assert torch.equal(torch.signbit(dq), torch.signbit(w))  # -0.0 survives
    expected_packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    assert torch.equal(p, expected_packed.reshape(rows, blocks * 16))
    assert torch.equal(dequantize_mxfp4(p, s, torch.bfloat16).float(), w)


def test_quantize_is_idempotent_on_arbitrary_encodings():
    # Every MXFP4 value set is representable again after re-quantization,
    # even when the block max is below the top binade (scale gets re-derived).
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 256, (8, 64), generator=g, dtype=torch.uint8)
    s = torch.randint(0, 255, (8, 4), generator=g, dtype=torch.uint8)
    dq = dequantize_mxfp4(p, s, torch.float32)
    assert torch.equal(_roundtrip(dq), dq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_roundtrip_within_bound(dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=g)
    # Per-block dynamic range from 2**-20 to 2**20 plus some outliers.
    w = w * torch.pow(2.0, torch.randint(-20, 21, (64, 16, 1), generator=g).float()).repeat_interleave(
        32, dim=1
    ).reshape(64, 512)
    w[torch.rand(w.shape, generator=g) < 0.01] *= 50.0
    w = w.to(dtype)
    w32 = w.float()
    p, s = quantize_mxfp4(w)
    dq = dequantize_mxfp4(p, s, torch.float32)
    assert torch.equal(dequantize_mxfp4(p, s, torch.bfloat16).float(), dq)
    err = (w32 - dq).abs()
    bound = mxfp4_roundtrip_error_bound(w)
    assert bound.dtype == torch.float32 and bound.shape == w.shape
    assert (err <= bound).all()
    # Documented relative guarantees.
    blocks = w32.reshape(64, 16, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    assert (err.reshape(64, 16, 32) <= 0.25 * amax).all()
    scale = torch.pow(2.0, s.float() - 127).repeat_interleave(32, dim=-1)
    assert (err <= 0.25 * torch.maximum(w32.abs(), scale)).all()
    # The bound is not vacuous: gaussian data gets near it somewhere.
    assert (err / bound).max() > 0.9
    # bf16 input is quantized exactly like its fp32 upcast.
    p32, s32 = quantize_mxfp4(w32)
    assert torch.equal(p, p32) and torch.equal(s, s32)


def test_matches_naive_scalar_reference():
    rng = random.Random(3)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    blocks = []
    for b in range(6):
        k = rng.randint(-30, 30)
        vals = [rng.uniform(4.0, 8.0) * rng.choice([-1, 1])]  # pins the binade
        for _ in range(31):
            r = rng.random()
            if r < 0.3:
                v = rng.choice(mids) * rng.choice([-1, 1])  # exact ties
            elif r < 0.4:
                v = rng.choice(MAGS) * rng.choice([-1, 1])
            elif r < 0.45:
                v = -0.0
            else:
                v = rng.uniform(-7.99, 7.99)
            vals.append(v)
        if b == 4:
            vals = [v * 0.1 for v in vals]  # block max not in a fixed binade
        blocks.append([v * 2.0**k for v in vals])
    blocks.append([rng.uniform(-1, 1) * 2.0**-130 for _ in range(32)])  # clamped exponent
    blocks.append([0.0] * 32)
    w = torch.tensor([x for blk in blocks for x in blk], dtype=torch.float32).reshape(4, 64)

    p, s = quantize_mxfp4(w)
    p_flat, s_flat = p.reshape(-1), s.reshape(-1)
    w_flat = w.reshape(-1).tolist()  # fp32-rounded values as Python floats
    for i in range(len(blocks)):
        byte, codes = _ref_quantize_block(w_flat[32 * i : 32 * (i + 1)])
        assert s_flat[i].item() == byte, f"block {i}"
        assert _codes(p_flat[16 * i : 16 * (i + 1)]) == codes, f"block {i}"


def test_batched_expert_shape():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 8, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    p, s = quantize_mxfp4(w)
    assert p.shape == (3, 8, 32) and s.shape == (3, 8, 2)
    for e in range(3):
        pe, se = quantize_mxfp4(w[e])
        assert torch.equal(p[e], pe) and torch.equal(s[e], se)
    dq = dequantize_mxfp4(p, s)
    assert dq.shape == (3, 8, 64) and dq.dtype == torch.bfloat16
    assert ((w.float() - dq.float()).abs() <= mxfp4_roundtrip_error_bound(w)).all()

    q = MXFP4Weight.from_dense(w)
    assert q.shape == (3, 8, 64)
    assert torch.equal(q.packed, p) and torch.equal(q.scales, s)
    assert q.nbytes == 3 * 8 * 32 + 3 * 8 * 2
    assert torch.equal(q.dequantize(torch.float32), dq.float())
    with pytest.raises(AttributeError):
        q.shape = (1,)  # frozen


def test_non_contiguous_input():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 32, generator=g).t()  # [32, 64], non-contiguous
    p, s = quantize_mxfp4(w)
    pc, sc = quantize_mxfp4(w.contiguous())
    assert torch.equal(p, pc) and torch.equal(s, sc)


# ---------------------------------------------------------------- error paths


@pytest.mark.parametrize("k", [48, 1, 33])
def test_k_not_multiple_of_32(k):
    with pytest.raises(ValueError, match=f"K={k}"):
        quantize_mxfp4(torch.ones(2, k))
    with pytest.raises(ValueError, match=f"K={k}"):
        mxfp4_roundtrip_error_bound(torch.ones(2, k))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input(bad):
    w = torch.ones(2, 32)
    w[1, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp4(w)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp4(w.to(torch.bfloat16))


def test_fp64_overflow_and_integer_inputs_rejected():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp4(torch.full((32,), 1e300, dtype=torch.float64))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_mxfp4(torch.ones(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scalar"):
        quantize_mxfp4(torch.tensor(1.0))


def test_scale_byte_255_rejected():
    p, s = quantize_mxfp4(torch.ones(2, 64))
    s[1, 0] = 255
    with pytest.raises(ValueError, match="255"):
        dequantize_mxfp4(p, s)
    q = MXFP4Weight(p, s, (2, 64))  # construction does not scan values
    with pytest.raises(ValueError, match="255"):
        q.dequantize()


def test_dequantize_validation():
    p, s = quantize_mxfp4(torch.ones(4, 64))
    with pytest.raises(ValueError, match="packed"):
        dequantize_mxfp4(p.to(torch.int8), s)
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(p, s.float())
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(p, s[:, :1])  # 1 * 16 != 32
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(p[:, :16], s)  # 2 * 16 != 16
    with pytest.raises(ValueError, match="leading dims"):
        dequantize_mxfp4(p, s[:3])
    with pytest.raises(ValueError, match="shape"):
        MXFP4Weight(p, s, (4, 32))
