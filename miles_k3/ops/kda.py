"""Kimi Delta Attention (KDA) ops.

Pure-torch references (fp32 math, fp64 for fp64 inputs, any device) and a CUDA fast path through
fla's Triton kernels. The references are the ground truth that kernels and
model code are tested against, so they favour clarity and numerical safety
over speed. The forget gate (with beta, in `kda_gate_beta`) runs its own Triton kernel
(`miles_k3.kernels.kda_gate`: one launch instead of about eight) where `miles_k3.kernels.use_kernels` says
so and the kernel takes the call.

Shapes used throughout (``N`` = number of sequences: ``B``, or
``len(cu_seqlens) - 1`` for packed input, where ``B`` must be 1):

    q, k           [B, T, H, K]   any float dtype
    v              [B, T, H, V]   any float dtype; ``o`` is returned in it
    g              [B, T, H, K]   log-space per-channel decay (fp32 preferred)
    beta           [B, T, H]      delta-rule write strength
    initial_state  [N, H, K, V]   recurrent state, read in the math dtype; or a `PooledState` (below)
    final_state    [N, H, K, V]   in the math dtype: fp32, or fp64 when q, k or v is fp64 (or None)

A `PooledState` as `kda`'s initial state is a state kept in a cache's pool (the engine's slots): the op reads
rows `index` of the pool and writes the final state back into them, and returns the same `PooledState` as
its final state. On CUDA a decode step (T = 1) does that inside a recurrent kernel reading and writing the
slots (ours, `miles_k3.kernels.kda_rows`, where `use_kernels` says so; else fla's, through its continuous-
batching state indices): no gathered copy of the states and no scatter back, the bytes that grow with the
batch; elsewhere the op gathers, runs as with a plain state, and scatters: the same values either way.
`FrozenRows` is the same start read and never written (a speculative verify's committed state): the op
returns no final state.

fp64 inputs keep fp64 math so that exactness tests (a context-parallel split against the unsplit op, whose
chunk boundaries and so summation orders differ) can hold to 1e-10; every other dtype computes in fp32.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from miles_k3.kernels import use_kernels
from miles_k3.ops import exact

__all__ = [
    "kda_gate",
    "kda_gate_beta",
    "l2norm",
    "math_dtype",
    "kda_recurrent",
    "kda_chunked",
    "kda",
    "kda_advance",
    "PooledState",
    "FrozenRows",
]

_GATE_FORMS = ("softplus", "lower_bound")
_MODES = ("auto", "recurrent", "chunked")


def _check_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, num_heads: int, form: str) -> int:
    """Validate `kda_gate`'s arguments; return the head dim K."""
    if form not in _GATE_FORMS:
        raise ValueError(f"`form` must be one of {_GATE_FORMS}, got {form!r}")
    H = num_heads
    if H <= 0 or f.dim() == 0 or f.shape[-1] % H != 0:
        raise ValueError(f"`f` last dim must be a positive multiple of num_heads={H}, got shape {tuple(f.shape)}")
    K = f.shape[-1] // H
    if A_log.numel() < H:
        raise ValueError(f"`A_log` needs at least num_heads={H} elements, got shape {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise ValueError(f"`dt_bias` must have H*K={H * K} elements, got shape {tuple(dt_bias.shape)}")
    return K


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    *,
    num_heads: int,
    form: str = "softplus",
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Log-space KDA forget gate.

    Args:
        f: ``[..., H*K]`` raw ``f_b_proj(f_a_proj(x))`` output, any float dtype.
        A_log: per-head log rate; any shape with ``numel >= H``. Only the first
            ``H`` values after flattening are used, because checkpoints store it
            as ``[H]``, ``[1, 1, H, 1]`` or zero-padded (e.g. ``[128]`` for H=96).
        dt_bias: ``[H*K]`` (any shape with that many elements) or None.
        form: ``"softplus"`` (Kimi-Linear): ``-exp(A_log[h]) * softplus(f + dt_bias)``;
            ``"lower_bound"`` (K3): ``lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``.

    Returns:
        ``[..., H, K]`` fp32 gate (fp64 for fp64 ``f``), ``<= 0``.
    """
    K = _check_gate(f, A_log, dt_bias, num_heads, form)
    H = num_heads
    if use_kernels(f):
        from miles_k3.kernels import kda_gate as kernels  # imported here: CPU installs never load triton

        if kernels.supports(f, A_log, dt_bias):
            return kernels.kda_gate(
                f, A_log, dt_bias, num_heads=H, softplus=form == "softplus", lower_bound=lower_bound
            )[0]

    dtype = math_dtype(f)
    x = f.to(dtype).unflatten(-1, (H, K))
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(H, K)
    rate = A_log.reshape(-1)[:H].unsqueeze(-1).to(dtype).exp()  # [H, 1]
    if form == "softplus":
        return -rate * F.softplus(x)
    return lower_bound * torch.sigmoid(rate * x)


def kda_gate_beta(
    f: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    *,
    num_heads: int,
    form: str = "softplus",
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forget gate and the delta-rule write strength together: ``(kda_gate(f, A_log, dt_bias, ...),
    sigmoid(b))`` with ``b`` the raw ``b_proj(x)`` output ``[..., H]`` (f's leading dims), beta in fp32
    (fp64 for fp64 ``b``). One kernel launch for both where the kernel runs (the gate's alone would leave
    beta's upcast and sigmoid, two more)."""
    _check_gate(f, A_log, dt_bias, num_heads, form)
    if b.shape != (*f.shape[:-1], num_heads):
        raise ValueError(f"`b` must be [..., H] = {(*f.shape[:-1], num_heads)}, got {tuple(b.shape)}")
    if use_kernels(f):
        from miles_k3.kernels import kda_gate as kernels

        if kernels.supports(f, A_log, dt_bias, b):
            return kernels.kda_gate(
                f, A_log, dt_bias, num_heads=num_heads, softplus=form == "softplus", lower_bound=lower_bound, b=b
            )
    g = kda_gate(f, A_log, dt_bias, num_heads=num_heads, form=form, lower_bound=lower_bound)
    return g, torch.sigmoid(b.to(math_dtype(b)))


def math_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the references compute in: fp32, or fp64 when any input is fp64."""
    out = torch.float32
    for t in tensors:
        out = torch.promote_types(out, t.dtype)
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last dim; any dtype in, fp32 out (fp64 for fp64)."""
    x = x.to(math_dtype(x))
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _cu_seqlens_bounds(cu_seqlens: torch.Tensor, batch: int, total: int, *, values: bool = True) -> list[int] | None:
    """Validate packed-sequence boundaries; return them as a list when ``values``.

    ``values=False`` skips the checks that need the data on the host, so the
    CUDA path does not pay for a device sync.
    """
    if batch != 1:
        raise ValueError(f"`cu_seqlens` requires batch size 1 (packed input), got B={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"`cu_seqlens` must be 1-D with >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if not values:
        return None
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"`cu_seqlens` must be non-decreasing from 0 to T={total}, got {bounds}")
    return bounds


def _check_kda_inputs(
    q, k, v, g, beta, initial_state, cu_seqlens, *, values: bool = True
) -> tuple[int, list[int] | None]:
    """Shape validation shared by every KDA entry point; returns (N, cu_seqlens bounds or None)."""
    if q.dim() != 4:
        raise ValueError(f"`q` must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"`v` must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"`g` must match q {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"`beta` must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    N, bounds = B, None
    if cu_seqlens is not None:
        bounds = _cu_seqlens_bounds(cu_seqlens, B, T, values=values)
        N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(
            f"`initial_state` must be [N, H, K, V] = {(N, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}"
        )
    return N, bounds


# A core takes head-major fp32 tensors for one batch of independent sequences:
# q (pre-scaled), k, g [b, H, T, K]; v [b, H, T, V]; beta [b, H, T]; S [b, H, K, V]
# and returns (o [b, H, T, V], S_final [b, H, K, V]). It must not modify S in place.
_Core = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _recurrent_core(q, k, v, g, beta, S):
    # exact mode: each contraction as a product and a sum over K, whose order no batch size changes
    read = _read_exact if exact.enabled() else _read
    outs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]
        S = S * g[:, :, t].exp().unsqueeze(-1)
        err = v[:, :, t] - read(k_t, S)
        S = S + (k_t * beta[:, :, t, None]).unsqueeze(-1) * err.unsqueeze(-2)
        outs.append(read(q[:, :, t], S))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


def _read(x, S):
    """x [b, H, K] through the state S [b, H, K, V] -> [b, H, V]."""
    return torch.einsum("bhk,bhkv->bhv", x, S)


def _read_exact(x, S):
    return (x.unsqueeze(-1) * S).sum(-2)


def _chunked_core(q, k, v, g, beta, S, *, chunk_size: int):
    b, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    pad = -T % C
    if pad:
        # Zero k/beta write nothing and zero g decays nothing, so the padded tail
        # leaves the state exactly as the last real token left it.
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    outs = []
    for s in range(0, T + pad, C):
        q_c, k_c, v_c, g_c, b_c = (x[:, :, s : s + C] for x in (q, k, v, g, beta))
        G = g_c.cumsum(2)  # decay from the chunk start through token i, <= 0 for forget gates
        # decay[i, j, :] = exp(G_i - G_j) for j <= i. The j > i half is exp of a
        # large positive number for strong gates (e.g. +320 for -5/step), so it is
        # masked to -inf *before* exp and never materialises as inf/NaN.
        diff = G.unsqueeze(3) - G.unsqueeze(2)
        decay = diff.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()
        A_kk = torch.einsum("bhid,bhijd,bhjd->bhij", k_c, decay, k_c)
        A_qk = torch.einsum("bhid,bhijd,bhjd->bhij", q_c, decay, k_c)
        # UT transform: the per-token delta-rule corrections u satisfy
        # (I + strict_tril(beta_i * A_kk)) u = beta * (v - (k * exp(G)) @ S), so
        # u = U - W @ S with state-independent U, W from one triangular solve.
        L = eye + (b_c.unsqueeze(-1) * A_kk).tril(-1)
        rhs = b_c.unsqueeze(-1) * torch.cat([v_c, k_c * G.exp()], dim=-1)
        U, W = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True).split([V, K], dim=-1)
        u = U - W @ S
        outs.append((q_c * G.exp()) @ S + A_qk @ u)
        # decay[:, :, -1] is exp(G_last - G_j): each token's write decayed to the chunk end.
        S = G[:, :, -1].exp().unsqueeze(-1) * S + (k_c * decay[:, :, -1]).transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2)[:, :, :T] if outs else v.new_zeros(b, H, 0, V)
    return o, S


def _kda_reference(core: _Core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    """Validation, fp32 promotion and the packed-sequence loop shared by both references."""
    N, bounds = _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    H, K = q.shape[2:]
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype, dtype = v.dtype, math_dtype(q, k, v)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # Head-major so the time axis sits next to the feature axis for per-chunk matmuls.
    q, k, v, g = (x.to(dtype).transpose(1, 2) for x in (q, k, v, g))
    q = q * scale
    beta = beta.to(dtype).transpose(1, 2)
    h0 = initial_state.to(dtype) if initial_state is not None else q.new_zeros(N, H, K, V)

    if bounds is None:
        o, ht = core(q, k, v, g, beta, h0)
    else:
        # Packed sequences run as one right-padded batch [N, H, T_max, .]: zero k / beta write nothing and
        # zero g decays nothing, so padding leaves each final state exactly as its last real token left it,
        # and causality keeps it out of the real outputs. One core call instead of one per sequence.
        lens = [eos - bos for bos, eos in zip(bounds[:-1], bounds[1:])]
        t_max = max(lens)
        segments = [[x[0, :, bos:eos] for bos, eos in zip(bounds[:-1], bounds[1:])] for x in (q, k, v, g, beta)]
        padded = [
            torch.stack([F.pad(seg, (0, 0) * (seg.dim() - 2) + (0, t_max - seg.shape[1])) for seg in segs])
            for segs in segments
        ]
        o_pad, ht = core(*padded, h0)
        o = torch.cat([o_pad[i, :, :n] for i, n in enumerate(lens)], dim=1).unsqueeze(0)
    return o.transpose(1, 2).to(out_dtype), (ht if output_final_state else None)


def kda_recurrent(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, use_qk_l2norm=False
):
    """Token-by-token KDA reference (fp32 math, fp64 for fp64 inputs, any device).

    Per head, with state ``S [K, V]``:
    ``S = diag(exp g_t) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (q_t * scale)``.
    ``scale`` defaults to ``K**-0.5``; ``use_qk_l2norm`` applies :func:`l2norm`
    to q and k first. See the module docstring for shapes and dtypes.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [N, H, K, V] in the math dtype, or None)``.
    """
    return _kda_reference(
        _recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm
    )


def kda_chunked(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    chunk_size=64,
):
    """Chunked (WY / UT-transform) KDA reference; same contract as :func:`kda_recurrent`.

    Sequences are zero-padded to a multiple of ``chunk_size``; each chunk solves
    a unit-lower-triangular system for its delta-rule corrections using decays
    relative to the chunk start, then hands its state to the next chunk.
    Peak extra memory is one ``[B, H, C, C, K]`` fp32 decay tensor (C = chunk_size).
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")

    def core(*args):
        return _chunked_core(*args, chunk_size=chunk_size)

    return _kda_reference(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm)


def _kda_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, values=False)
    from fla.ops.kda import chunk_kda, fused_recurrent_kda  # lazy: needs triton + a GPU

    # fla's fused recurrent kernel is forward-only, so a T=1 call that needs
    # gradients goes through chunk_kda, which has a backward.
    tensors = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    fn = chunk_kda if q.shape[1] > 1 or needs_grad else fused_recurrent_kda
    o, ht = fn(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state.float() if initial_state is not None else None,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
    )
    return o.to(v.dtype), (ht.float() if ht is not None else None)


class PooledState(NamedTuple):
    """N states kept in a pool: rows `index` [N] (int64) of `pool` ([slots, H, K, V] fp32 for `kda`,
    [slots, D, W-1] for `miles_k3.ops.short_conv.causal_short_conv`, whose planes of the engine's
    [slots, 3, D, W-1] conv pool are strided views). Rows may repeat only where their results do not matter
    (the engine's padding rows share its sink slot)."""

    pool: torch.Tensor
    index: torch.Tensor


class FrozenRows(NamedTuple):
    """N initial states read from rows `index` [N] of `pool` ([slots, H, K, V] fp32) and never written: `kda`
    computes the outputs from them and returns no final state (a speculative verify reads the committed state;
    the fold writes what is accepted). Meant for short rows (a verify's few tokens): on CUDA the recurrent
    kernel (`miles_k3.kernels.kda_rows`), which runs a row's tokens one after another."""

    pool: torch.Tensor
    index: torch.Tensor


def _fla_pool_fits(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether fla's recurrent kernel can step `pool`'s rows in place for `q`: CUDA, no autograd, an fp32 pool
    whose rows are contiguous (any slot stride: the unified arena's); never in exact mode."""
    return (
        q.is_cuda
        and not exact.enabled()
        and not torch.is_grad_enabled()
        and pool.dtype == torch.float32
        and pool[0].is_contiguous()
    )


def _kda_fla_in_place(
    q, k, v, g, beta, state: PooledState, scale, use_qk_l2norm, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """fla's recurrent kernel reading and writing pool rows `index` (its continuous-batching mode, the same
    arithmetic as its plain mode, so the state is the one the gathered call would give) -> o. `rows` [N, T]:
    the pool row each token's state is written to, the first token's also read (default: `index`, T = 1)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # lazy: needs triton + a GPU

    _check_kda_inputs(q, k, v, g, beta, None, None, values=False)
    rows = state.index if rows is None else rows
    if (
        state.pool.shape[1:] != (q.shape[2], q.shape[3], v.shape[-1])
        or state.index.shape != (q.shape[0],)
        or rows.shape not in ((q.shape[0],), tuple(q.shape[:2]))
    ):
        raise ValueError(
            f"pooled state {tuple(state.pool.shape)} / index {tuple(state.index.shape)} / rows "
            f"{tuple(rows.shape)} does not fit q {tuple(q.shape)}, v {tuple(v.shape)}"
        )
    o, _ = fused_recurrent_kda_fwd(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        g=g.contiguous(),
        beta=beta.contiguous(),
        scale=scale,
        initial_state=state.pool,
        inplace_final_state=True,
        ssm_state_indices=rows,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return o.to(v.dtype)


def _kda_pooled(q, k, v, g, beta, state: PooledState, **kwargs):
    """`kda` from and back into a pooled state (module docstring): in place for a CUDA decode step without
    autograd (nor while torch.compile traces: the opt-in compiled decode step keeps the gathered call it
    traced before), through our kernel where `use_kernels` says so, else fla's state indices; otherwise
    gather, compute, scatter."""
    pool, index = state
    if kwargs["mode"] == "auto" and q.shape[1] == 1 and kwargs["cu_seqlens"] is None:
        if (rows := _rows_kernel(q, v, pool)) is not None:
            return rows(
                q, k, v, g, beta, pool, index, scale=kwargs["scale"], use_qk_l2norm=kwargs["use_qk_l2norm"], write=True
            ), state
        if not torch.compiler.is_compiling() and _fla_pool_fits(q, pool):
            return _kda_fla_in_place(q, k, v, g, beta, state, kwargs["scale"], kwargs["use_qk_l2norm"]), state
    o, ht = kda(q, k, v, g, beta, initial_state=pool.index_select(0, index), output_final_state=True, **kwargs)
    pool.index_copy_(0, index, ht.to(pool.dtype))
    return o, state


def _rows_kernel(q: torch.Tensor, v: torch.Tensor, pool: torch.Tensor) -> Callable | None:
    """Our recurrent kernel's entry (`miles_k3.kernels.kda_rows.kda_rows`) when it takes a pooled call:
    `use_kernels` (CUDA, inference mode, not while compiling) and a pool it reads in place; else None."""
    if not use_kernels(q):
        return None
    from miles_k3.kernels import kda_rows  # imported here: CPU installs never load triton

    return kda_rows.kda_rows if kda_rows.supports(q, v, pool) else None


def _kda_frozen(q, k, v, g, beta, state: FrozenRows, **kwargs):
    """`kda` from read-only pool rows (`FrozenRows`): our kernel where it fits, else the gathered call."""
    pool, index = state
    if kwargs["mode"] == "auto" and (rows := _rows_kernel(q, v, pool)) is not None:
        return rows(
            q,
            k,
            v,
            g,
            beta,
            pool,
            index,
            scale=kwargs["scale"],
            use_qk_l2norm=kwargs["use_qk_l2norm"],
            write=False,
            cu_seqlens=kwargs["cu_seqlens"],
        ), None
    o, _ = kda(q, k, v, g, beta, initial_state=pool.index_select(0, index), output_final_state=False, **kwargs)
    return o, None


def kda_advance(q, k, v, g, beta, state: PooledState, *, scratch: int, scale=None, use_qk_l2norm=False) -> None:
    """Advance pool rows `state.index` [N] by their T tokens each (q, k, g [N, T, H, K], v [N, T, H, V], beta
    [N, T, H]), token by token as T decode steps of `kda` would, and write back only the final states. A token
    whose g and beta are zero leaves its row's state bit for bit (decay exp(0) = 1, a zero write), so rows
    advance by different counts in one call (the speculative fold's masked block).

    On CUDA, the decode step's kernel over the T tokens: ours (`miles_k3.kernels.kda_rows`, where
    `use_kernels` says so), which reads a row's state once and writes it once; else fla's recurrent kernel in
    its continuous-batching mode with per-token state rows: each row's slot at the first and last token and
    `scratch` (a pool row nobody reads, written by every row) in between. Either way the arithmetic per token
    is the decode step's (same kernel, fixed tiling), so the states equal T decode steps' bit for bit.
    Elsewhere the recurrent reference, gathered and scattered."""
    pool, index = state
    if (rows := _rows_kernel(q, v, pool)) is not None:
        rows(q, k, v, g, beta, pool, index, scale=scale, use_qk_l2norm=use_qk_l2norm, write=True)
        return
    if _fla_pool_fits(q, pool):
        return _kda_fla_advance(q, k, v, g, beta, state, scratch, scale, use_qk_l2norm)
    _, ht = kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=pool.index_select(0, index),
        output_final_state=True,
        use_qk_l2norm=use_qk_l2norm,
        mode="recurrent",
    )
    pool.index_copy_(0, index, ht.to(pool.dtype))


def _kda_fla_advance(q, k, v, g, beta, state: PooledState, scratch: int, scale, use_qk_l2norm) -> None:
    """`kda_advance` through fla's recurrent kernel (its docstring)."""
    rows = torch.full(q.shape[:2], scratch, dtype=torch.long, device=state.index.device)  # [N, T]
    rows[:, 0] = rows[:, -1] = state.index
    _kda_fla_in_place(q, k, v, g, beta, state, scale, use_qk_l2norm, rows=rows)


def kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    mode="auto",
    chunk_size=64,
):
    """KDA with backend dispatch; same contract as :func:`kda_recurrent`, and a `PooledState` as
    `initial_state` is updated in place and returned as the final state, a `FrozenRows` only read (no final
    state) (module docstring).

    ``mode``: ``"recurrent"`` / ``"chunked"`` force the torch references on any
    device. ``"auto"`` uses fla on CUDA (``chunk_kda`` for T > 1, the
    forward-only ``fused_recurrent_kda`` for T == 1 without autograd); elsewhere
    it uses the chunked reference when ``T >= chunk_size``, else the recurrent one.
    """
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}")
    if isinstance(initial_state, FrozenRows):
        return _kda_frozen(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            scale=scale,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm,
            mode=mode,
            chunk_size=chunk_size,
        )
    if isinstance(initial_state, PooledState):
        return _kda_pooled(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            scale=scale,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm,
            mode=mode,
            chunk_size=chunk_size,
        )
    kwargs = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
    )
    if exact.enabled():  # token by token on both sides, whatever the length (miles_k3.ops.exact)
        return kda_recurrent(q, k, v, g, beta, **kwargs)
    if mode == "auto" and q.is_cuda:
        return _kda_fla(q, k, v, g, beta, **kwargs)
    # Packed sequences run padded to the longest one, so that length picks the reference.
    longest = q.shape[1] if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if mode == "recurrent" or (mode == "auto" and longest < chunk_size):
        return kda_recurrent(q, k, v, g, beta, **kwargs)
    return kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
