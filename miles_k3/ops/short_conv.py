"""Causal depthwise short convolution with carried state (KDA's q/k/v short conv).

The state holds the last ``W-1`` *pre-activation inputs* of the previous call,
oldest first, so that prefill followed by token-by-token decode reproduces the
full-sequence forward exactly.

Unpacked calls run a Triton kernel (`miles_k3.kernels.short_conv`: output and new
state in one launch instead of about eight) where `miles_k3.kernels.use_kernels`
says so and the kernel takes the call: the engine's decode and verify steps.
Packed rows (cu_seqlens) run the code below, the definition that kernel is
tested against, on every device; fla's ``causal_conv1d``
(fla.modules.convolution) could take them on CUDA once tested against it.
`causal_short_convs` is several such calls (a KDA layer's q, k and v) in one
launch where the kernel takes them together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_k3.kernels import use_kernels
from miles_k3.ops import exact
from miles_k3.ops.kda import PooledState, _cu_seqlens_bounds, math_dtype

__all__ = ["causal_short_conv", "causal_short_convs"]

_ACTIVATIONS = ("silu", None)


def _conv_core(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, D, T], weight [D, W], state [b, D, W-1], all fp32 -> (y [b, D, T], state [b, D, W-1])."""
    T = x.shape[-1]
    W = weight.shape[-1]
    xx = torch.cat([state, x], dim=-1)  # [b, D, W-1+T]: history then current inputs
    if T == 1 and not exact.enabled():  # exact mode: the taps one by one, as a longer input adds them
        # Decode: the window is all of xx. One product and one sum instead of 2W-1 small ops per call: a
        # decode step runs this for q, k and v of every KDA layer, one GPU kernel per op.
        return (xx * weight).sum(-1, keepdim=True), xx[..., 1:]
    # Tap j looks W-1-j steps back, so weight[:, -1] multiplies the current token.
    # An explicit tap sum (W is tiny) keeps this independent of F.conv1d, which the tests use.
    y = weight[:, 0, None] * xx[..., :T]
    for j in range(1, W):
        y = y + weight[:, j, None] * xx[..., j : j + T]
    return y, xx[..., T:]


def _packed_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences in one pass. x [T, D] (sequences back to back), state [N, D, W-1], cu_seqlens [N+1]
    -> (y [T, D], state [N, D, W-1]). Each sequence gets its own history spliced in front of it
    (ext = s_0 x_0 s_1 x_1 ...): sequence i's segment starts at cu_i + i (W-1), so token t of sequence i
    sits at ext[t + (i+1)(W-1)] and its tap j reads ext[t + i (W-1) + j], the same taps as `_conv_core`
    per sequence. Indices are built on x's device from cu_seqlens (no host round trip, no Python loop
    over sequences), so a packed forward on CUDA does not wait for the device here.

    Token-major (ext [T + N (W-1), D]): every gather and scatter moves whole rows. The backward of a gather
    along the last dim of a channel-major ext was CUDA's index_add over strided columns, 0.46 ms a call and
    8% of a k3-small train step's device time (H200, 2026-12-03). index_select, not ext[idx]: the backward
    of advanced indexing is CUDA's sort-based deterministic kernel (once 67% of that step); index_select's
    is index_add, and each call's indices are distinct, so it is exact too."""
    T, D = x.shape
    W = weight.shape[-1]
    n = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    tokens = torch.arange(T, device=x.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)  # sequence of each token
    first = tokens + seq * (W - 1)  # ext row of each token's oldest tap
    hist = torch.arange(W - 1, device=x.device)
    starts = cu[:-1] + torch.arange(n, device=x.device) * (W - 1)  # where each segment's history begins
    ext = x.new_zeros(T + n * (W - 1), D)
    ext = ext.index_copy(0, first + (W - 1), x)
    ext = ext.index_copy(0, (starts[:, None] + hist).reshape(-1), state.transpose(1, 2).reshape(-1, D))
    y = weight[:, 0] * ext.index_select(0, first)
    for j in range(1, W):
        y = y + weight[:, j] * ext.index_select(0, first + j)
    lens = cu[1:] - cu[:-1]
    tail = (starts + lens)[:, None] + hist  # [N, W-1]: each segment's last W-1 inputs
    return y, ext.index_select(0, tail.reshape(-1)).unflatten(0, (n, W - 1)).transpose(1, 2)


def _flat_weight(weight: torch.Tensor) -> torch.Tensor:
    """[D, W] from HF's nn.Conv1d(groups=D) layout [D, 1, W]; any other shape as it is (validated later)."""
    return weight.squeeze(1) if weight.dim() == 3 and weight.shape[1] == 1 else weight


def causal_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution ``y[t, d] = act(sum_j weight[d, j] * xx[t + j])``.

    ``xx`` is the input left-padded with ``state`` (zeros when None).

    Args:
        x: ``[B, T, D]`` any float dtype.
        weight: ``[D, W]``, or ``[D, 1, W]`` (the HF ``nn.Conv1d(groups=D)`` layout).
        state: ``[N, D, W-1]`` last ``W-1`` pre-activation inputs of the previous
            call, oldest first; ``N = B``, or ``len(cu_seqlens) - 1`` when packed. Or a
            ``PooledState`` (rows ``index`` of a ``[slots, D, W-1]`` pool, any strides): read
            there and rewritten there with the final state, which is returned as the same
            ``PooledState`` (in place in the kernel where it takes the call, else gathered
            and scattered: the same values).
        cu_seqlens: ``[N+1]`` integer boundaries of packed sequences (requires
            ``B == 1``); each sequence starts from its own state row and never
            sees the previous sequence's tokens.
        activation: ``"silu"`` or ``None``.

    Returns:
        ``(y [B, T, D] in x.dtype, final_state [N, D, W-1])``; the state keeps
        ``state``'s dtype (so a caller's cache dtype is stable), else x's. The
        final state is the last ``W-1`` inputs of each sequence, reaching back
        into the carried state when the sequence is shorter than ``W-1``.
        Math is done in fp32 (fp64 for fp64 input).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {_ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"`x` must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    weight = _flat_weight(weight)
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"`weight` must be [D, W] or [D, 1, W] with D={D}, got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if cu_seqlens is not None:
        # the values are checked where reading them costs no device sync
        _cu_seqlens_bounds(cu_seqlens, B, T, values=not cu_seqlens.is_cuda)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if isinstance(state, PooledState):
        return _pooled(x, weight, state, cu_seqlens, activation, N)
    if state is not None and state.shape != (N, D, W - 1):
        raise ValueError(f"`state` must be [N, D, W-1] = {(N, D, W - 1)}, got {tuple(state.shape)}")
    if use_kernels(x):
        from miles_k3.kernels import short_conv as kernels  # imported here: CPU installs never load triton

        if kernels.supports(x, weight, state, cu_seqlens):
            return kernels.causal_short_conv(x, weight, state, silu=activation == "silu")

    # Channel-major so the time axis is last, matching the state layout.
    dtype = math_dtype(x)
    xt = x.to(dtype).transpose(1, 2)
    w = weight.to(dtype)
    s0 = state.to(dtype) if state is not None else xt.new_zeros(N, D, W - 1)
    if cu_seqlens is None:
        y, s = _conv_core(xt, w, s0)
    else:
        y, s = _packed_conv(xt[0].T, w, s0, cu_seqlens)
        y = y.T[None]  # [1, D, T] as the unpacked path's; the transpose below makes it token-major again
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype), s.to(state.dtype if state is not None else x.dtype)


def _pooled(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: PooledState,
    cu_seqlens: torch.Tensor | None,
    activation: str | None,
    n: int,
) -> tuple[torch.Tensor, PooledState]:
    """`causal_short_conv` from and back into a pooled state (its docstring)."""
    pool, index = state
    if pool.shape[1:] != (x.shape[2], weight.shape[1] - 1) or index.shape != (n,):
        raise ValueError(
            f"pooled state {tuple(pool.shape)} / index {tuple(index.shape)} does not fit x "
            f"{tuple(x.shape)} and a {weight.shape[1]}-tap weight"
        )
    if use_kernels(x) and cu_seqlens is None:
        from miles_k3.kernels import short_conv as kernels  # imported here: CPU installs never load triton

        if kernels.supports_in_place(x, weight, pool):
            return kernels.causal_short_conv_(x, weight, pool, index, silu=activation == "silu"), state
    y, new = causal_short_conv(
        x, weight, state=pool.index_select(0, index), cu_seqlens=cu_seqlens, activation=activation
    )
    pool.index_copy_(0, index, new)
    return y, state


def causal_short_convs(
    xs: list[torch.Tensor],
    weights: list[torch.Tensor],
    *,
    states: list[torch.Tensor | PooledState | None],
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> list[tuple[torch.Tensor, torch.Tensor | PooledState]]:
    """``[causal_short_conv(x, w, state=s, cu_seqlens=..., activation=...) for x, w, s in zip(...)]``, the same
    values; one kernel launch for all of them where `use_kernels` says so and the kernel takes the group
    (`miles_k3.kernels.short_conv.supports_group`: one shape, dtype and stride set per kind of tensor; the
    states all tensors, all None, or all `PooledState`s of one index, stepped in place). A KDA layer's q, k, v
    are such a group in the engine: three launches a layer become one. Packed groups (`cu_seqlens`, the
    training forward) run as one call over their stacked channels where they can (`_stackable`)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {_ACTIVATIONS}, got {activation!r}")
    if len(xs) > 1 and cu_seqlens is None and use_kernels(xs[0]):
        from miles_k3.kernels import short_conv as kernels  # imported here: CPU installs never load triton

        flat = [_flat_weight(w) for w in weights]
        silu = activation == "silu"
        if all(isinstance(st, PooledState) for st in states) and all(st.index is states[0].index for st in states):
            pools = [st.pool for st in states]
            if states[0].index.shape == (xs[0].shape[0],) and kernels.supports_group(xs, flat, pools, pooled=True):
                ys = kernels.causal_short_convs_(xs, flat, pools, states[0].index, silu=silu)
                return list(zip(ys, states))
        elif all(st is None for st in states) or all(isinstance(st, torch.Tensor) for st in states):
            plain = None if states[0] is None else states
            if kernels.supports_group(xs, flat, plain):
                return kernels.causal_short_convs(xs, flat, plain, silu=silu)
    if len(xs) > 1 and cu_seqlens is not None and _stackable(xs, weights, states):
        return _stacked(xs, weights, states, cu_seqlens, activation)
    return [
        causal_short_conv(x, w, state=st, cu_seqlens=cu_seqlens, activation=activation)
        for x, w, st in zip(xs, weights, states)
    ]


def _stackable(xs: list[torch.Tensor], weights: list[torch.Tensor], states: list) -> bool:
    """Whether the group can run as one convolution over its channels stacked: a depthwise convolution is
    per channel, so one call over the concatenated channels computes every value as the separate calls do."""
    taps = {w.shape[-1] for w in weights}
    plain = all(st is None for st in states) or (
        all(isinstance(st, torch.Tensor) for st in states) and len({st.dtype for st in states}) == 1
    )
    return (
        len(taps) == 1
        and plain
        and len({(x.shape[:-1], x.dtype, x.device) for x in xs}) == 1
        and all(x.dim() == 3 for x in xs)
    )


def _stacked(xs, weights, states, cu_seqlens, activation) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The packed group (a KDA layer's q, k, v in training and packed prefill) as one call over the stacked
    channels, then split: the packed path's index building and its per-tap ops run once, not once per
    member, which the host-bound train step on CUDA pays in launches (its backward too)."""
    sizes = [x.shape[-1] for x in xs]
    flat = [_flat_weight(w) for w in weights]
    state = None if states[0] is None else torch.cat(states, dim=1)
    y, final = causal_short_conv(
        torch.cat(xs, dim=-1), torch.cat(flat), state=state, cu_seqlens=cu_seqlens, activation=activation
    )
    return list(zip(y.split(sizes, dim=-1), final.split(sizes, dim=1)))
