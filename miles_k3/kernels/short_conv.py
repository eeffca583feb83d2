"""KDA's causal depthwise short convolution with carried state, output and new state in one kernel.

The torch definition (`miles_k3.ops.short_conv.causal_short_conv`) upcasts x and the state, concatenates
them, multiplies, sums, applies SiLU and casts the output and the new state back: eight kernels per call on
CUDA, three calls (q, k, v) per KDA layer per decode step. This reads each input once, computes in fp32
registers and writes both results, one kernel.

Contract of `causal_short_conv(x, weight, state, silu)` (`supports` says which calls qualify;
`miles_k3.ops.short_conv` sends the others to the definition):
- x [B, T, D], any strides (a decode step's q / k / v are column slices of one shared GEMM output); weight
  [D, W], any strides; state [B, D, W-1] (the last W-1 inputs before x, oldest first), any strides (the
  engine's is a view of its pool's [slots, 3, D, W-1]), or None for a zero history. Each fp32 / bf16 / fp16.
  Any T >= 0: decode (T = 1), a verify step's few tokens, a whole unpacked row; not packed rows (cu_seqlens).
- returns (y [B, T, D] contiguous in x's dtype, new state [B, D, W-1] contiguous in state's dtype, or x's
  without a state): y[t, d] = silu(sum_j weight[d, j] * xx[t + j]) (no silu with `silu` False) over
  xx = state ++ x in fp32, taps added in the definition's order (j = 0 first); the new state is the last W-1
  entries of xx.
- against the definition: the new state is the same copy through fp32 and the same round-to-nearest-even
  (`rounding.round_to`), so bit-identical (the engine's bf16 x into a bf16 state is exact). y matches to fp32
  rounding (exp is the device's, and the GPU may fuse a tap's multiply-add), so in bf16 / fp16 it is the
  definition's value or one unit in the last place away where the two fp32 values straddle a rounding tie.

`causal_short_conv_(x, weight, pool, index, silu)` is the same with row b's state in slot index[b] of a pool
[slots, D, W-1] (any strides: the engine's q / k / v planes of [slots, 3, D, W-1]), the new state written
back there (the engine's `PooledState`: no gather before, no scatter after). Only for T <= MAX_BT
(`supports_in_place`), where one program per row and channel block both reads the row's state and rewrites
it; a barrier before each rewrite keeps every thread's reads of the old entries ahead of it. Rows sharing a
slot (the engine's padding rows on its sink) leave that slot undefined.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from miles_k3.kernels.rounding import DTYPES, round_to

MAX_BT = 16  # tokens per time block


@triton.jit(do_not_specialize=["T"])  # T = 1 (decode) would otherwise make a constexpr of it
def _short_conv(
    xs,
    ws,
    ss,
    ys,
    out_ss,
    idx_ptr,
    T,
    D,
    ND,
    sx_b,
    sx_t,
    sx_d,
    sw_d,
    sw_j,
    ss_b,
    ss_d,
    ss_j,
    os_b,
    os_d,
    os_j,
    W: tl.constexpr,
    HAS_STATE: tl.constexpr,
    SILU: tl.constexpr,
    IN_PLACE: tl.constexpr,
    G: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    tb = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    # program_id(1) walks the G convolutions' channel blocks: this program's convolution is g, its tensors
    # the g-th of each tuple (one stride set serves all G: `supports_group`)
    g = tl.program_id(1) // ND
    x_ptr, w_ptr, s_ptr, y_ptr, out_s_ptr = xs[0], ws[0], ss[0], ys[0], out_ss[0]
    for i in tl.static_range(1, G):
        if g == i:
            x_ptr = xs[i]
            w_ptr = ws[i]
            s_ptr = ss[i]
            y_ptr = ys[i]
            out_s_ptr = out_ss[i]
    if IN_PLACE:  # row b's state is slot idx[b] of a pool, read and rewritten there (out_s_ptr == s_ptr)
        slot = tl.load(idx_ptr + b).to(tl.int64)
    else:
        slot = b
    # int64 positions: t * stride reaches past 2**31 on long rows of a wide GEMM output
    t = (tb * BT).to(tl.int64) + tl.arange(0, BT)
    d = (tl.program_id(1) % ND) * BD + tl.arange(0, BD)
    d_ok = d < D
    t_ok = t < T
    x_row = x_ptr + b * sx_b
    s_row = s_ptr + slot * ss_b
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        # tap j of token t reads xx[t + j]: x at t + j - (W-1), or the state at t + j before x starts
        p = t + j - (W - 1)
        ok = t_ok[:, None] & d_ok[None, :]
        xv = tl.load(x_row + p[:, None] * sx_t + d[None, :] * sx_d, mask=ok & (p >= 0)[:, None], other=0.0).to(
            tl.float32
        )
        if HAS_STATE:
            from_state = (p < 0)[:, None]
            sv = tl.load(s_row + d[None, :] * ss_d + (t + j)[:, None] * ss_j, mask=ok & from_state, other=0.0).to(
                tl.float32
            )
            xv = tl.where(from_state, sv, xv)
        w = tl.load(w_ptr + d * sw_d + j * sw_j, mask=d_ok, other=0.0).to(tl.float32)
        if j == 0:
            acc = w[None, :] * xv  # the definition's first term, not 0 + it (which turns -0 into +0)
        else:
            acc = acc + w[None, :] * xv
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))  # torch's silu; -0 stays -0, large negatives give -0
    y_ptrs = y_ptr + (b * T + t[:, None]) * D + d[None, :]
    tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok)

    # the new state, xx[T : T + W-1], written once per row and channel block (by the first time block,
    # which exists even for T = 0), through fp32 as the definition's copy goes
    if tb == 0:
        for i in tl.static_range(W - 1):
            # where entry i of the new state sits in x (< 0: in the state), one per lane (a scalar mask
            # broadcast into a vector one is not something Triton's interpreter takes)
            # (names of their own: Triton's compiler types a name once per scope; p and sv above are [BT] tiles)
            q = tl.full([BD], i - (W - 1), tl.int64) + T
            v = tl.load(x_row + q * sx_t + d * sx_d, mask=d_ok & (q >= 0), other=0.0).to(tl.float32)
            if HAS_STATE:
                old = tl.load(s_row + d * ss_d + (T + i) * ss_j, mask=d_ok & (q < 0), other=0.0)
                v = tl.where(q < 0, old.to(tl.float32), v)
            if IN_PLACE:  # entry i was read by every thread (taps, or entry i - T above) before it is rewritten
                tl.debug_barrier()
            out = out_s_ptr + slot * os_b + d * os_d + i * os_j
            tl.store(out, round_to(v, out_s_ptr.dtype.element_ty), mask=d_ok)


def supports(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> bool:
    """Whether the kernel takes this call of `miles_k3.ops.short_conv.causal_short_conv` (its shapes
    already checked there); else the definition runs. Not packed rows, not fp64 math, one device."""
    tensors = (x, weight) + ((state,) if state is not None else ())
    return cu_seqlens is None and all(t.dtype in DTYPES and t.device == x.device for t in tensors)


def supports_group(
    xs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor | None] | None,
    pooled: bool = False,
) -> bool:
    """Whether `causal_short_convs` (or, `pooled`, `causal_short_convs_` with `states` the pools) takes these
    convolutions in one launch: each as `supports` (in place: `supports_in_place`) with the shapes the
    single calls check, and one dtype and stride set per kind of tensor across the group (a KDA layer's q,
    k, v: column slices of one GEMM output, their weights, their planes of the conv pool)."""
    x, w = xs[0], weights[0]
    if x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[2] or len(xs) != len(weights):
        return False
    (B, _, D), width = x.shape, w.shape[1]
    state_shape = None if states is None else (states[0].shape[0], D, width - 1) if pooled else (B, D, width - 1)
    if states is not None and (len(states) != len(xs) or any(s.shape != state_shape for s in states)):
        return False
    same = (
        all(t.shape == x.shape and t.dtype == x.dtype and t.stride() == x.stride() for t in xs)
        and all(t.shape == w.shape and t.dtype == w.dtype and t.stride() == w.stride() for t in weights)
        and (states is None or all(t.dtype == states[0].dtype and t.stride() == states[0].stride() for t in states))
    )
    single = (
        supports_in_place(x, w, states[0]) if pooled else supports(x, w, None if states is None else states[0], None)
    )
    return same and single and all(t.device == x.device for t in (*xs, *weights, *(states or ())))


def _blocks(T: int, D: int) -> tuple[int, int]:
    bt = min(MAX_BT, triton.next_power_of_2(max(T, 1)))
    # decode: a row's channels over several programs of 256 (on the H200 at k3-small's 3 x 1024 channels,
    # 2.3 / 8.8 us at batch 1 / 256 against 3.9 / 11.1 for one program of 1024, bench_decode_kernels.py)
    return bt, min(triton.next_power_of_2(D), 2048 // bt, 256)


def supports_in_place(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether `causal_short_conv_` takes this call: `supports`' conditions, and T within one time block
    (every program that reads a row's state is the one that rewrites it)."""
    return supports(x, weight, pool, None) and x.shape[1] <= MAX_BT


def causal_short_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, D], weight [D, W], state [B, D, W-1] or None -> (y [B, T, D], new state [B, D, W-1]) in one
    launch (module docstring); `silu` False leaves the convolution without activation."""
    return causal_short_convs([x], [weight], None if state is None else [state], silu)[0]


def causal_short_convs(
    xs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor] | None,
    silu: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`causal_short_conv` of each (x, weight, state) in one launch (`supports_group`; states all given or
    None) -> [(y, new state)] in order."""
    B, T, D = xs[0].shape
    W = weights[0].shape[1]
    assert weights[0].shape == (D, W) and (states is None or states[0].shape == (B, D, W - 1))
    dtype = (states[0] if states is not None else xs[0]).dtype
    new_states = [torch.empty(B, D, W - 1, dtype=dtype, device=xs[0].device) for _ in xs]
    ys = _launch(xs, weights, states, new_states, None, silu)
    return list(zip(ys, new_states))


def causal_short_conv_(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, silu: bool = True
) -> torch.Tensor:
    """As `causal_short_conv` with row b's state in slot index[b] of `pool` [slots, D, W-1] (any strides),
    rewritten there with the new state (`supports_in_place`) -> y."""
    return causal_short_convs_([x], [weight], [pool], index, silu)[0]


def causal_short_convs_(
    xs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    pools: Sequence[torch.Tensor],
    index: torch.Tensor,
    silu: bool = True,
) -> list[torch.Tensor]:
    """`causal_short_conv_` of each (x, weight, pool), all rows' slots `index`, in one launch
    (`supports_group(pooled=True)`) -> [y] in order."""
    B, T, D = xs[0].shape
    assert pools[0].shape[1:] == (D, weights[0].shape[1] - 1) and index.shape == (B,)
    assert supports_in_place(xs[0], weights[0], pools[0])
    return _launch(xs, weights, pools, pools, index, silu)


def _launch(xs, weights, states, out_states, index, silu) -> list[torch.Tensor]:
    B, T, D = xs[0].shape
    ys = [torch.empty(B, T, D, dtype=x.dtype, device=x.device) for x in xs]
    if B == 0 or D == 0:
        return ys
    bt, bd = _blocks(T, D)
    nd = triton.cdiv(D, bd)
    ss = tuple(states) if states is not None else tuple(xs)  # any pointers: never read without a state
    s_strides = states[0].stride() if states is not None else (0, 0, 0)
    grid = (max(1, triton.cdiv(T, bt)), len(xs) * nd, B)
    _short_conv[grid](
        tuple(xs),
        tuple(weights),
        ss,
        tuple(ys),
        tuple(out_states),
        index if index is not None else xs[0],
        T,
        D,
        nd,
        *xs[0].stride(),
        *weights[0].stride(),
        *s_strides,
        *out_states[0].stride(),
        W=weights[0].shape[1],
        HAS_STATE=states is not None,
        SILU=silu,
        IN_PLACE=index is not None,
        G=len(xs),
        BT=bt,
        BD=bd,
    )
    return ys
