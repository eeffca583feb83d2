"""Exact mode (`rollout.exact=true`): the engine and the trainer give bit-identical log-probs for the same
tokens and adapter, whatever a token's batch, padding or cache path was (paged decode or packed training, a
prefix hit, a retracted and recomputed request, a speculative verify).

A float sum rounds by its order, and kernels pick their order by the shape of the call, so the two builds of
the one K3 definition agree to ~1e-7 but not to the bit. Under `exact()` every op a token's logits go through
computes a token's result from that token's own data in an order fixed by the model alone:

- Matmuls run through `RowInvariant`, a torch function mode: the rows of a product (tokens, queries) go in
  tiles of `TILE` zero-padded rows, so a row's result does not depend on how many rows share the call. (On
  the CPU's BLAS a one-row product takes a GEMV path whose sums round differently from the GEMM that a batch
  takes; on whole tiles every row takes the same kernel. Measured on MKL: any row count, any offset, bit for
  bit; a product's column count must not change either, so the engine keeps its GEMMs unconcatenated.) Ops
  with a reduction order of their own (einsum, SDPA, grouped GEMMs) are refused inside the mode, naming the
  op, so a path that would break exactness fails loudly instead of drifting.
- Attention (`attention`): each query's softmax runs over its visible keys padded with masked ones to a
  multiple of `KEY_BLOCK`: the same length, so the same reduction, for the packed training row and the
  engine's gathered history. The engine uses the expanded form (keys and values through kv_b_proj), as the
  trainer does, never the absorbed one.
- One algorithm per op on both sides: KDA token by token (`kda`'s recurrent core, its contractions as a
  product and a sum over a fixed axis), the short convolution's taps added one by one, routed experts looped
  per expert (no grouped GEMM) and combined in expert order, log-probs as torch's log_softmax at the token.
- No Triton kernels, no CUDA graphs: `miles_k3.kernels.use_kernels` is false.

The mode holds for a thread (`numerics`): a rank's trainer and its colocated engine run in one. It needs one
model replica per process (no TP / PP / CP / EP in either build: a collective sums in its own order) and the
engine's weights equal to the trainer's (no MXFP4 base), which `rollout.exact`'s check asks of the config.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TILE = 8  # rows per matmul tile
NARROW = 16  # a product with fewer columns is padded to this many
KEY_BLOCK = 16  # attention's key axis is padded to a multiple of this (>= TILE, so no narrow product)

_state = threading.local()  # a torch function mode holds for the thread that entered it


def enabled() -> bool:
    """Whether the calling thread computes in exact mode."""
    return getattr(_state, "mode", None) is not None


@contextlib.contextmanager
def numerics(on: bool = True) -> Iterator[None]:
    """Exact mode in the calling thread while the block runs (`on` false, or already on: nothing changes).
    The trainer's and the engine's forwards must run in such a block: a rank's main thread (the launchers
    hold one around a rank's whole life, a Ray actor around each call)."""
    if not on or enabled():
        yield
        return
    mode = _state.mode = RowInvariant()
    mode.__enter__()
    try:
        yield
    finally:
        _state.mode = None
        mode.__exit__(None, None, None)


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """Plain numerics while the block runs, inside exact mode: for computations no log-prob depends on (the
    speculative drafter only proposes tokens; the target's verify forward decides and reports)."""
    mode = getattr(_state, "mode", None)
    if mode is None:
        yield
        return
    mode.__exit__(None, None, None)
    _state.mode = None
    try:
        yield
    finally:
        mode.__enter__()
        _state.mode = mode


# On CPU, what the process must start with (read when torch and MKL load): ATen's elementwise kernels compute a
# vector's worth of elements with SIMD functions and the rest with scalar ones, which round exp and the like
# differently, so a token's bits would depend on where its row falls in the tensor ("default": one
# implementation for both); MKL picks code paths by the operands' alignment ("COMPATIBLE": one path).
CPU_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def cpu_env_missing() -> list[str]:
    """The `CPU_ENV` settings this process did not start with ("NAME=value" each; empty: all set)."""
    missing = [f"{k}={v}" for k, v in CPU_ENV.items() if os.environ.get(k, "").lower() != v.lower()]
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT" and "ATEN_CPU_CAPABILITY=default" not in missing:
        missing.append("ATEN_CPU_CAPABILITY=default")  # set after torch was imported: too late
    return missing


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with broadcasting as torch.matmul, computed so that row i of the result depends on row i of `a`
    and on `b` only: rows padded to whole tiles of `TILE`, columns to at least `NARROW`, and the operands in
    one memory layout."""
    if a.dim() == 1 and b.dim() == 1:
        return matmul(a[None], b[:, None])[0, 0]
    if a.dim() == 1:
        return matmul(a[None], b)[..., 0, :]
    if b.dim() == 1:
        return matmul(a, b[:, None])[..., 0]
    m, n = a.shape[-2], b.shape[-1]
    pad = -m % TILE
    if pad or m == 0:
        pad = pad or TILE
        a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, a.shape[-1])], dim=-2)
    if n < NARROW:  # a narrow product takes a kernel of its own: as wide as the others, the rest zeros
        b = torch.cat([b, b.new_zeros(*b.shape[:-1], NARROW - n)], dim=-1)
    # one memory layout for every call (the BLAS picks its kernel by the operands' strides too): a row-major,
    # b column-major, which a weight's transpose (x @ W^T) already is
    a = a.contiguous()
    if not b.transpose(-1, -2).is_contiguous():
        b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    # contiguous, as a plain product's: a later op's kernel (and so its rounding) follows its input's strides
    return torch.matmul(a, b)[..., :m, :n].contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear as `matmul`: x [..., K] @ weight [N, K]^T (+ bias)."""
    out = matmul(x.reshape(-1, x.shape[-1]), weight.t()).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.linalg.matmul}
_STRICT = {torch.mm: 2, torch.Tensor.mm: 2, torch.bmm: 3, torch.Tensor.bmm: 3}  # their operands' one rank
_REFUSED = {
    torch.einsum: "einsum",
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
    torch.baddbmm: "baddbmm",
    torch.addmm: "addmm",
    torch.Tensor.addmm: "addmm",
    torch.mv: "mv",
    torch.Tensor.mv: "mv",
    torch.dot: "dot",
    torch.Tensor.dot: "dot",
    torch.inner: "inner",
    torch.tensordot: "tensordot",
}
if hasattr(torch, "_grouped_mm"):
    _REFUSED[torch._grouped_mm] = "_grouped_mm"


class RowInvariant(TorchFunctionMode):
    """Reroutes F.linear and the matmuls to `linear` / `matmul`; refuses the ops whose order it cannot fix
    (module docstring). Inside its own handler the mode is off, so the rerouted calls reach torch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func in _MATMULS or func in _STRICT:
            if kwargs.pop("out", None) is not None:
                raise RuntimeError("exact mode: a matmul into out= is not row-invariant here")
            names = ("input", "mat2") if func in _STRICT else ("input", "other")
            a, b = (*args, *(kwargs[n] for n in names[len(args) :]))
            rank = _STRICT.get(func)
            if rank is not None and not (a.dim() == b.dim() == rank and a.shape[:-2] == b.shape[:-2]):
                return func(a, b)  # torch's own refusal of the shapes
            return matmul(a, b)
        name = _REFUSED.get(func)
        if name is not None:
            raise RuntimeError(
                f"exact mode (rollout.exact): torch.{name} sums in an order of its own; this path has no "
                "row-invariant form yet"
            )
        return func(*args, **kwargs)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one sequence's queries q [T, H, Dqk] over its keys k [S, H, Dqk], v [S, H, Dv]:
    query i sees keys [0, visible[i]) (int64 [T], each >= 1). -> [T, H, Dv] in v's dtype, fp32 math (fp64
    for fp64 inputs).

    Each query's scores span its visible keys padded with masked ones to L = visible rounded up to
    `KEY_BLOCK` (keys past S are zeros): queries of one L run together, so a query's softmax and its
    weighted sum of values have the same length and order wherever it is computed. A masked key's weight
    is exactly 0."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (x.to(dtype).transpose(0, 1) for x in (q, k, v))  # head-major [H, ., D]
    out = qf.new_zeros(qf.shape[0], qf.shape[1], vf.shape[-1])
    lengths = (visible + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK
    s = kf.shape[1]
    for length in lengths.unique().tolist():
        rows = (lengths == length).nonzero()[:, 0]
        keys, values = kf[:, :length], vf[:, :length]
        if length > s:
            keys = torch.cat([keys, keys.new_zeros(keys.shape[0], length - s, keys.shape[-1])], dim=1)
            values = torch.cat([values, values.new_zeros(values.shape[0], length - s, values.shape[-1])], dim=1)
        scores = matmul(qf[:, rows] * scale, keys.transpose(1, 2))  # [H, r, L]
        hidden = torch.arange(length, device=q.device)[None, :] >= visible[rows, None].to(q.device)
        probs = scores.masked_fill(hidden[None], float("-inf")).softmax(dim=-1)
        out[:, rows] = matmul(probs, values)
    return out.transpose(0, 1).to(v.dtype)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bounds: list[int]):
    """Causal `attention` within each sequence packed in q [1, T, H, Dqk], k, v [1, T, H, .] (`bounds`: the
    sequences' offsets, cu_seqlens) -> [1, T, H, Dv]."""
    outs = []
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        visible = torch.arange(1, eos - bos + 1)
        outs.append(attention(q[0, bos:eos], k[0, bos:eos], v[0, bos:eos], scale, visible))
    return torch.cat(outs)[None]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """`attention` of a batch q [B, T, H, Dqk] over k, v [B, S, H, .] under `mask` (None: causal with T == S;
    a bool tensor broadcastable to [B, H, T, S], True = attend): each query's visible keys must be a prefix of
    its row's keys (the engine's history before its own position), which is checked."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if mask is None:
        visible = torch.arange(s - t + 1, s + 1).expand(b, t)
    else:
        if not isinstance(mask, torch.Tensor):
            mask = mask.dense(q.device)
        heads = mask.shape[-3] if mask.dim() >= 3 else 1
        full = torch.broadcast_to(mask, (b, heads, t, s)).cpu()
        m = full[:, 0]
        visible = m.sum(-1)
        prefix = torch.arange(s)[None, None, :] < visible[..., None]
        if not torch.equal(full, m[:, None].expand_as(full)) or not torch.equal(m, prefix):
            raise RuntimeError("exact mode: attention needs each query's keys to be a prefix of its row, in every head")
    return torch.stack([attention(q[i], k[i], v[i], scale, visible[i]) for i in range(b)])
