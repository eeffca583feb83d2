"""MXFP4 (OCP Microscaling, FP4 E2M1 elements + E8M0 block scales) in pure torch.

Layout (identical to compressed-tensors ``mxfp4-pack-quantized``): a dense
tensor ``w[..., K]`` is split along its last dimension into blocks of
``MXFP4_BLOCK_SIZE = 32`` consecutive elements.

* ``scales``: uint8 ``[..., K/32]``. Byte ``b`` encodes the E8M0 value
  ``2**(b - 127)``; ``b == 255`` is the E8M0 NaN and is rejected.
* ``packed``: uint8 ``[..., K/2]``. Each element is a 4-bit E2M1 code
  ``sign << 3 | magnitude_index`` (magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``);
  element ``2k`` sits in the LOW nibble of byte ``k`` and element ``2k + 1``
  in the HIGH nibble.

For a weight ``[out, in]`` that gives ``weight_packed [out, in/2]`` and
``weight_scale [out, in/32]``.

Everything is vectorised torch (no Python loops over elements), so it runs
unchanged on CPU and CUDA. Validation that inspects values (non-finite inputs,
NaN scale bytes) needs one host sync per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "FP4_E2M1_VALUES",
    "MXFP4_BLOCK_SIZE",
    "E8M0_BIAS",
    "E8M0_NAN",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "mxfp4_roundtrip_error_bound",
    "MXFP4Weight",
]

MXFP4_BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# Largest exponent of E2M1 (6 = 1.5 * 2**2); OCP picks the shared exponent so
# that the block max lands in the top binade of the element format.
_E2M1_EMAX = 2
_E2M1_MAX = 6.0
_SCALE_EXP_MIN = -127
_SCALE_EXP_MAX = 127

# Value of each 4-bit code 0..15. Code 8 is -0.0 (sign bit set, magnitude 0).
FP4_E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

# Midpoints between consecutive magnitudes, split by which way a tie goes.
# A tie between indices i and i+1 goes to the even index (even mantissa bit):
# for even i that is the lower neighbour, so the midpoint counts only when
# strictly exceeded; for odd i it is the upper neighbour, so reaching the
# midpoint already counts: index = #(_MIDS_TIE_DOWN < a) + #(_MIDS_TIE_UP <= a).
_MIDS_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)  # between (0,1), (2,3), (4,5), (6,7)
_MIDS_TIE_UP = (0.75, 1.75, 3.5)  # between (1,2), (3,4), (5,6)


def _exp2_int(e: Tensor) -> Tensor:
    """Exact fp32 ``2**e`` for an integer tensor ``e`` in ``[-149, 127]``.

    Built from the IEEE bit pattern rather than ``torch.exp2``/``pow`` so the
    result is exact on every backend, including the subnormal ``2**-127``
    used for the smallest E8M0 scale.
    """
    e = e.to(torch.int32)
    normal_bits = (e.clamp(min=-126) + 127) << 23
    # Subnormal fp32: value = mantissa * 2**-149, so 2**e has bit (e + 149).
    subnormal_bits = torch.ones_like(e) << (e.clamp(-149, -127) + 149)
    return torch.where(e >= -126, normal_bits, subnormal_bits).view(torch.float32)


def _check_dense(w: Tensor) -> Tensor:
    """Validate a dense input and return it as fp32 blocks ``[..., K/32, 32]``."""
    if not isinstance(w, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"MXFP4 quantization needs a floating-point tensor, got {w.dtype}")
    if w.dim() == 0:
        raise ValueError("MXFP4 quantization needs at least 1 dimension, got a scalar")
    k = w.shape[-1]
    if k % MXFP4_BLOCK_SIZE != 0:
        raise ValueError(
            f"last dimension K={k} must be a multiple of the MXFP4 block size "
            f"{MXFP4_BLOCK_SIZE} (shape {tuple(w.shape)})"
        )
    # Cast first so that fp64 values beyond the fp32 range are caught as inf.
    w32 = w.to(torch.float32)
    if not bool(torch.isfinite(w32).all()):
        raise ValueError("MXFP4 quantization input contains NaN or Inf")
    # bucketize warns on (and copies) non-contiguous inputs; make one copy up front.
    return w32.contiguous().reshape(*w.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)


def _block_exponent(blocks: Tensor) -> Tensor:
    """Shared exponent per block, int32 ``[..., K/32]``.

    ``floor(log2(amax)) - 2`` clamped to ``[-127, 127]``; all-zero blocks get
    the minimum ``-127`` (scale byte 0), the limit of the rule as amax -> 0.
    """
    amax = blocks.abs().amax(dim=-1)
    # frexp gives amax = m * 2**p with m in [0.5, 1), so floor(log2) = p - 1
    # exactly (also for subnormals), without a float log2 that could round.
    _, p = torch.frexp(amax)
    e = p.to(torch.int32) - 1 - _E2M1_EMAX
    e = torch.where(amax > 0, e, torch.full_like(e, _SCALE_EXP_MIN))
    return e.clamp(_SCALE_EXP_MIN, _SCALE_EXP_MAX)


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize ``w[..., K]`` to MXFP4; returns ``(packed, scales)``.

    Returns ``packed`` uint8 ``[..., K/2]`` and ``scales`` uint8 ``[..., K/32]``
    on ``w``'s device.

    Contract:

    * ``K`` must be a multiple of 32, ``w`` floating point and finite;
      otherwise ``ValueError``. Any float dtype is accepted; the math is done
      in fp32 (fp64 inputs are rounded to fp32 first).
    * Shared exponent (OCP MX v1.0): ``e = floor(log2(amax)) - 2`` where
      ``amax`` is the block's max ``|w|`` and 2 is the E2M1 emax; clamped to
      the E8M0 range ``[-127, 127]``. An all-zero block gets ``e = -127``
      (scale byte 0). Scale byte is ``e + 127``; 255 (NaN) is never produced.
      For fp32-representable inputs ``e <= 125``, so only the lower clamp can
      ever bind (blocks with ``amax < 2**-125``).
    * Elements: ``a = |w| / 2**e`` is rounded to the nearest E2M1 magnitude,
      ties to the even code index (= even mantissa bit), e.g. 0.25 -> 0,
      0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. Since
      ``amax / 2**e`` lies in ``[4, 8)``, magnitudes above 6 saturate to 6
      (not to NaN/Inf: E2M1 has neither).
    * Sign is taken from the sign bit, so ``-0.0`` and negatives that round to
      zero become code 8 (``-0``), exactly as IEEE rounding would.
    """
    blocks = _check_dense(w)
    e = _block_exponent(blocks)
    # Multiplying by an exact power of two is exact (short of underflow into
    # the subnormals, which only affects values far below the 0.25 threshold),
    # so the tie comparisons below see the true scaled value.
    a = blocks.abs() * _exp2_int(-e).unsqueeze(-1)

    mids_down = torch.tensor(_MIDS_TIE_DOWN, dtype=torch.float32, device=a.device)
    mids_up = torch.tensor(_MIDS_TIE_UP, dtype=torch.float32, device=a.device)
    # bucketize(right=False) counts boundaries strictly below a; right=True
    # counts boundaries <= a. Anything above 5 gets index 7 (= 6): saturation.
    idx = torch.bucketize(a, mids_down, right=False) + torch.bucketize(a, mids_up, right=True)
    codes = idx.to(torch.uint8) | (torch.signbit(blocks).to(torch.uint8) << 3)

    codes = codes.reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    scales = (e + E8M0_BIAS).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()


def _check_packed(packed: Tensor, scales: Tensor) -> None:
    for name, t in (("packed", packed), ("scales", scales)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {t.dtype}")
        if t.dim() == 0:
            raise ValueError(f"{name} must have at least 1 dimension, got a scalar")
    if packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(
            f"packed leading dims {tuple(packed.shape[:-1])} do not match scales "
            f"leading dims {tuple(scales.shape[:-1])}"
        )
    if scales.shape[-1] * (MXFP4_BLOCK_SIZE // 2) != packed.shape[-1]:
        raise ValueError(
            f"scales last dim {scales.shape[-1]} * 16 != packed last dim "
            f"{packed.shape[-1]} (packed {tuple(packed.shape)}, scales {tuple(scales.shape)})"
        )
    if packed.device != scales.device:
        raise ValueError(f"packed on {packed.device} but scales on {scales.device}")


_CODE_TABLES: dict[torch.device, Tensor] = {}


def _code_table(device: torch.device) -> Tensor:
    # Built once per device: a fresh host-to-device copy on every decode would wait for the device.
    if device not in _CODE_TABLES:
        _CODE_TABLES[device] = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    return _CODE_TABLES[device]


def dequantize_mxfp4(
    packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16, *, check: bool = True
) -> Tensor:
    """Decode MXFP4 ``(packed [..., K/2], scales [..., K/32])`` to ``[..., K]``.

    Both inputs must be uint8 with equal leading dims and
    ``scales.shape[-1] * 16 == packed.shape[-1]``; a scale byte of 255 (E8M0
    NaN) is rejected. Any violation raises ``ValueError`` naming the tensor.
    ``check=False`` skips those checks (the NaN test waits for the device): only
    for buffers that `quantize_mxfp4` produced or that were checked when loaded,
    such as the engine's weights, which it decodes on every forward.

    Values are formed exactly in fp32 (``code_value * 2**(byte - 127)``) and
    then cast to ``dtype``. That cast is lossless for bf16/fp32 (every MXFP4
    value has at most 2 significant bits and lies within their exponent
    range); for narrower dtypes such as fp16 it may under/overflow.
    """
    if check:
        _check_packed(packed, scales)
        if bool((scales == E8M0_NAN).any()):
            raise ValueError("scales contains the E8M0 NaN encoding (byte 255)")

    lo = packed & 0x0F
    hi = packed >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    values = _code_table(packed.device)[codes.long()]

    scale = _exp2_int(scales.to(torch.int32) - E8M0_BIAS)
    k = values.shape[-1]
    blocks = values.reshape(*values.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)
    out = (blocks * scale.unsqueeze(-1)).reshape(values.shape)
    return out.to(dtype)


def mxfp4_roundtrip_error_bound(w: Tensor) -> Tensor:
    """Elementwise fp32 bound on ``|w - dequantize(quantize(w))|``.

    With ``s = 2**e`` the block scale chosen by :func:`quantize_mxfp4`:

    * in-range elements (``|w| <= 6 s``): the bound is ``s``, i.e. half the
      largest E2M1 step (1.0, between 4 and 6) times the scale;
    * saturated elements (``6 s < |w| < 8 s``): the bound is ``|w| - 6 s``,
      the exact clamping error (less than ``2 s``).

    So the returned tensor is ``max(s, |w| - 6 s)``. The bound holds exactly
    when the difference is evaluated in fp32, since ``s`` is a power of two
    and the saturated case computes the same expression.

    Guaranteed relative bound (half-step per E2M1 binade is at most 1/4 of
    the magnitude, and saturation only happens below ``8 s``): for every
    element ``|err| <= 0.25 * max(|w|, s)``, and hence
    ``|err| <= 0.25 * amax_block`` whenever ``s <= amax_block / 4``, i.e. the
    exponent was not clamped (``amax_block >= 2**-125``). For tinier blocks
    (scale byte 0) the elementwise form still holds and gives
    ``|err| < 2**-127``. All-zero blocks round-trip exactly.

    Validates ``w`` like :func:`quantize_mxfp4` (same ``ValueError`` cases).
    """
    blocks = _check_dense(w)
    s = _exp2_int(_block_exponent(blocks)).unsqueeze(-1)
    bound = torch.maximum(s.expand_as(blocks), blocks.abs() - _E2M1_MAX * s)
    return bound.reshape(w.shape)


@dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4-quantized tensor in the layout of this module.

    ``packed`` is uint8 ``[..., K/2]``, ``scales`` uint8 ``[..., K/32]`` and
    ``shape`` the dense shape ``(..., K)``; consistency is checked on
    construction (``ValueError``). Scale bytes are not scanned for 255 until
    :meth:`dequantize`, to keep construction free of host syncs.
    """

    packed: Tensor
    scales: Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_packed(self.packed, self.scales)
        expected = (*self.packed.shape[:-1], self.packed.shape[-1] * 2)
        if tuple(self.shape) != expected:
            raise ValueError(f"shape {tuple(self.shape)} does not match packed {tuple(self.packed.shape)}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @classmethod
    def from_dense(cls, w: Tensor) -> MXFP4Weight:
        """Quantize ``w`` with :func:`quantize_mxfp4`."""
        packed, scales = quantize_mxfp4(w)
        return cls(packed, scales, tuple(w.shape))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """Dense tensor of ``self.shape`` via :func:`dequantize_mxfp4`."""
        return dequantize_mxfp4(self.packed, self.scales, dtype)

    @property
    def nbytes(self) -> int:
        """Storage of packed codes plus scales, in bytes."""
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()
