"""KDA and its short conv over a sequence split into contiguous segments (context parallelism), pure torch.

The delta rule is affine in the state: per head, a run over tokens 1..t maps a start state S [K, V] to
S_t = M_t S + B_t, where M_t [K, K] depends on q, k, g, beta only and B_t is the run from a zero state.
Outputs are o_t = S_t^T q_t = o0_t + S^T w_t with w_t = M_t^T q_t. So every segment runs from a zero state
(o0, and b = the state its last sequence piece ends in), and once more over its first piece from the
identity with v = 0 (`kda` then returns w as outputs and M as the final state); the segments' transitions
(M, b) compose in rank order to each segment's start state (`start_states`, a scan over `size` small
matrices), and `correct` adds the start state's read-out to the first piece. Exact: no step is an
approximation, only the summation order differs from the unsplit op. Cost per segment: one extra KDA pass
over its first piece with K value channels, and one exchange of (M, b) per layer.

A sequence boundary inside a segment resets the state (the first piece is the only one that continues an
earlier segment's sequence; the last is the only one that carries on into the next).

The short conv needs the W-1 inputs before a segment that continues a sequence: `segment_conv` takes them
(`halo`, from the previous segment's tail) and masks those before the sequence's start.

`kda_split_reference` / `short_conv_split_reference` run all segments in one process: the tests hold them
equal to the unsplit ops, and `megatron_patches.context_parallel` runs the same pieces with one segment per
rank and collectives in between.
"""

from __future__ import annotations

import torch

from miles_k3.ops.kda import kda, math_dtype
from miles_k3.ops.short_conv import causal_short_conv

__all__ = [
    "segment_pass",
    "start_states",
    "correct",
    "halo_state",
    "segment_conv",
    "kda_split_reference",
    "short_conv_split_reference",
]


def segment_pass(
    q, k, v, g, beta, bounds: list[int], *, scale: float | None = None, use_qk_l2norm: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One segment from a zero state. q, k, g [1, S, H, K], v [1, S, H, V], beta [1, S, H]; `bounds` the
    sequence boundaries inside the segment ([0, ..., S]).

    Returns (o0 [1, S, H, V] in the math dtype, w [1, L, H, K] for the first piece of L tokens,
    transition [H, K, K + V] = (M | b): the first piece's state map and the last piece's zero-start end state).
    """
    dtype = math_dtype(q, k, v)
    q, k, v = (x.to(dtype) for x in (q, k, v))  # the references compute in it anyway; fla takes one dtype
    cu = torch.tensor(bounds, device=q.device)
    o0, ends = kda(q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm)
    n = bounds[1]
    first = [x[:, :n] for x in (q, k, g, beta)]
    heads, dk = q.shape[2], q.shape[3]
    eye = torch.eye(dk, dtype=dtype, device=q.device).expand(1, heads, dk, dk)
    w, m = kda(
        first[0],
        first[1],
        q.new_zeros(1, n, heads, dk, dtype=dtype),
        first[2],
        first[3],
        scale=scale,
        initial_state=eye,
        output_final_state=True,
        use_qk_l2norm=use_qk_l2norm,
    )
    return o0, w, torch.cat([m[0], ends[-1].to(dtype)], dim=-1)


def start_states(transitions: torch.Tensor, continues: list[bool], single: list[bool]) -> torch.Tensor:
    """Every segment's start state from all segments' transitions [R, H, K, K + V] (rank order).

    continues[j]: segment j starts inside a sequence begun earlier; single[j]: segment j holds no sequence
    boundary (its first piece is its last). Returns [R, H, K, V]: segment j + 1 starts from
    M_j S_j + b_j (the sequence crossed all of segment j), b_j (it began inside segment j) or zero.
    Every entry is built from `transitions` by the same ops whatever the flags (they enter as 0 / 1
    factors), so its backward touches every segment's transition on every rank alike."""
    dk = transitions.shape[-2]
    m, b = transitions[..., :dk], transitions[..., dk:]
    state = torch.zeros_like(b[0])
    states = [state]
    for j in range(len(continues) - 1):
        carried = float(single[j]) * torch.einsum("hij,hjv->hiv", m[j], state) + b[j]
        state = float(continues[j + 1]) * carried
        states.append(state)
    return torch.stack(states)


def correct(o0: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Add the start state's read-out to the first piece: o0 [1, S, H, V], w [1, L, H, K], state [H, K, V]."""
    n = w.shape[1]
    return torch.cat([o0[:, :n] + torch.einsum("bthk,hkv->bthv", w, state), o0[:, n:]], dim=1)


def halo_state(tail: torch.Tensor, seg_start: int, seq_start: int, num_pieces: int) -> torch.Tensor:
    """The conv state of a segment's pieces [num_pieces, D, W-1]: the first piece reads `tail` [W-1, D]
    (the inputs at positions seg_start - W + 1 ... seg_start - 1), zeroed before its sequence's start
    `seq_start`; the other pieces start their sequences and read zeros."""
    width = tail.shape[0]
    pos = torch.arange(seg_start - width, seg_start, device=tail.device)
    first = (tail * (pos >= seq_start).to(tail.dtype)[:, None]).t()
    return torch.cat([first[None], first.new_zeros(num_pieces - 1, *first.shape)])


def segment_conv(x: torch.Tensor, weight: torch.Tensor, bounds: list[int], state: torch.Tensor) -> torch.Tensor:
    """`causal_short_conv` over one segment x [1, S, D] with sequence boundaries `bounds` and the pieces'
    state from `halo_state`."""
    cu = torch.tensor(bounds, device=x.device)
    return causal_short_conv(x, weight, state=state.to(x.dtype), cu_seqlens=cu)[0]


def _segments(total: int, cu_seqlens: torch.Tensor | None, size: int):
    if total % size:
        raise ValueError(f"a row of {total} tokens does not split into {size} equal segments")
    bounds = [0, total] if cu_seqlens is None else sorted({int(b) for b in cu_seqlens.tolist()})
    n = total // size
    for r in range(size):
        start, end = r * n, (r + 1) * n
        inner = [0, *(b - start for b in bounds if start < b < end), n]
        yield start, end, inner, r > 0 and start not in bounds, max(b for b in bounds if b <= start)


def kda_split_reference(
    q,
    k,
    v,
    g,
    beta,
    *,
    cu_seqlens: torch.Tensor | None,
    size: int,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """`kda` over a packed row [1, T, ...] computed as `size` contiguous segments in one process."""
    segs = list(_segments(q.shape[1], cu_seqlens, size))
    passes = [
        segment_pass(*(x[:, s:e] for x in (q, k, v, g, beta)), inner, scale=scale, use_qk_l2norm=use_qk_l2norm)
        for s, e, inner, _, _ in segs
    ]
    states = start_states(
        torch.stack([p[2] for p in passes]), [c for *_, c, _ in segs], [len(inner) == 2 for _, _, inner, _, _ in segs]
    )
    return torch.cat([correct(o0, w, states[r]) for r, (o0, w, _) in enumerate(passes)], dim=1).to(v.dtype)


def short_conv_split_reference(
    x: torch.Tensor, weight: torch.Tensor, *, cu_seqlens: torch.Tensor | None, size: int
) -> torch.Tensor:
    """`causal_short_conv` over a packed row x [1, T, D] as `size` contiguous segments, each reading the
    previous segment's last W-1 inputs (segments must hold at least W-1 tokens)."""
    width = weight.shape[-1] - 1
    outs = []
    for r, (s, e, inner, _, seq_start) in enumerate(_segments(x.shape[1], cu_seqlens, size)):
        if e - s < width:
            raise ValueError(f"segments of {e - s} tokens are shorter than the conv's history ({width})")
        tail = x[0, s - width : s] if r > 0 else x.new_zeros(width, x.shape[-1])
        state = halo_state(tail, s, seq_start if r > 0 else s, len(inner) - 1)
        outs.append(segment_conv(x[:, s:e], weight, inner, state))
    return torch.cat(outs, dim=1)
