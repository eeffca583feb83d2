"""Sampling noise that is a pure function of (request seed, token position, vocabulary index).

A request's draw for the token at position p uses the uniforms u[i] = U(seed, p, i), i over the vocabulary,
and nothing else: no generator state. So the whole batch's noise is one computation (one kernel on CUDA,
fused into the sampler: `rollout.kernels.sampling`) instead of one generator call per row, and a request
draws the same token at the same position whatever batch, schedule, retraction or prefix hit brought it
there (only its logits decide).

The hash is defined on uint32 words and written twice, here in torch (the definition: int64 tensors holding
uint32 values, products split so nothing exceeds 2^63) and in the Triton kernel; tests hold the two equal
bit for bit. `mix` is Wellons' lowbias32. Each row gets two keys, (a, b), from its seed's two words and its
position; element i's word is mix(mix(a ^ i) ^ b), so two rows whose first keys differ by a small xor still
draw unrelated words (b differs). A uniform is the word's top 23 bits as an odd multiple of 2^-24: exactly
representable in fp32 and never 0 or 1.
"""

from __future__ import annotations

import functools

import torch

MASK = 0xFFFFFFFF
MIX_1, MIX_2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
SEED_SALT, KEY_SALT = 0x3C6EF372, 0xA54FF53A
MAX_SEED = 1 << 62  # seeds are drawn in [0, 2^62) (`rollout.engine`); both words of one are hashed
STREAM_SALT = 0x510E527F


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x holding uint32 values, with every intermediate below 2^49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK


def mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds [B] in [0, 2^62), positions [B] in [0, 2^32), int64 -> the rows' keys (a, b), uint32 values."""
    s = mix(mix((seeds & MASK) ^ SEED_SALT) ^ (seeds >> 32))
    a = mix(s ^ (positions & MASK))
    return a, mix(a ^ KEY_SALT)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds and positions (int64, any device) -> [B, vocab] fp32 uniforms in (0, 1) (module docstring)."""
    a, b = row_keys(seeds, positions)
    i = torch.arange(vocab, device=seeds.device)
    h = mix(mix(a[:, None] ^ i[None, :]) ^ b[:, None])
    return ((h >> 9) * 2 + 1).float() * 2.0**-24


def _mix32(x: int) -> int:
    """`mix` on one Python int holding a uint32 value."""
    x ^= x >> 16
    x = (x * MIX_1) & MASK
    x ^= x >> 15
    x = (x * MIX_2) & MASK
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=1 << 16)  # a speculative step asks for every row's streams: most were asked before
def stream_seed(seed: int, stream: int) -> int:
    """The seed of a request's noise stream `stream`: 0 is the request's seed itself (the plain sampler's
    draws), and each other stream is an unrelated seed in [0, 2^62) derived from both words of the seed, so a
    request draws independent noise for different purposes at the same position (speculation's drafts,
    acceptance tests and final tokens: `rollout.spec.verify`)."""
    if stream == 0:
        return seed
    lo = _mix32(_mix32((seed & MASK) ^ STREAM_SALT ^ stream) ^ (seed >> 32))
    hi = _mix32(lo ^ _mix32(stream ^ KEY_SALT))
    return ((hi << 32) | lo) % MAX_SEED


def exponentials(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws [B, vocab] fp32: -log of `uniforms`."""
    return -torch.log(uniforms(seeds, positions, vocab))
