"""Context parallelism for the trainer: the zigzag sequence split over megatron's CP group and the
`ContextParallel` share the sequence mixers consult (see `miles_k3.model.context`).

    cp = policy.model.cp                                   # context_share(), built by build_policy
    layout = cp.split(input_ids.shape[1], cu_seqlens)      # ZigzagLayout of the packed row [1, N]
    with cp.sharded(layout):
        hidden = policy.model(layout.shard(input_ids))     # [1, 2c, D]: this rank's tokens, no cu_seqlens
    logp = token_logprobs(policy, hidden[0], layout.shard(targets)[0], temperature)
    loss = -(logp * layout.real).sum()                     # local tokens only; the padding is not real
    # summed over the CP group: the loss (cp.sum), and every LoRA gradient (replicated over CP)
    cp.gather_tokens(logp, layout, dim=0)                  # [N] in row order, for logging / the rollout

Collectives per layer (forward; each backward mirrors its own): KDA moves its input and output between the
zigzag layout and the rank's contiguous segment (two all-to-alls of this rank's tokens, no rank receives
more than its share), all-gathers the last W-1 conv inputs of q, k and v and one (M, b) transition
[H, K, K + V] per rank (`miles_k3.ops.kda_cp`); MLA all-gathers the normalized latent KV (kv_lora_rank +
rope dims a token) and expands every rank's keys locally; its mask is a `SegmentCausalMask` (positions and
sequence ids), so a long row's attention runs blockwise with no [2c, padded] tensor. On CUDA the KDA
recurrence runs in fla's `chunk_kda(cp_context=...)` (contiguous layout: the same segments), which exchanges
the states itself.

Gloo pitfalls designed around: every collective sits in an autograd Function that every rank of the group
reaches in the same order (the same ops on every rank; the rank only picks a slice by index, so the
backward of each gather runs on every rank, even where its slice is unused), and nothing blocks on a
point-to-point send inside backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from miles_k3.model.context import NO_CP, ContextParallel, ZigzagLayout
from miles_k3.ops.kda_cp import correct, halo_state, segment_conv, segment_pass, start_states
from miles_k3.ops.mla import SegmentCausalMask


def context_share() -> ContextParallel:
    """This rank's CP share from megatron's parallel state (the base class when CP is 1)."""
    if ps.get_context_parallel_world_size() == 1:
        return NO_CP
    return MegatronCP()


class _AllGather(torch.autograd.Function):
    """x [...] -> [size, ...], every rank's x in rank order; backward: each rank gets the sum over ranks of
    the gradients of its own slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad[0])
        dist.reduce_scatter(out, [g.contiguous() for g in grad.unbind(0)], group=ctx.group)
        return out, None


def _chunk_plan(layout: ZigzagLayout, forward: bool) -> tuple[list[int], list[int], list[int], list[int]]:
    """Which chunks this rank sends / receives to move from zigzag to segment order (`forward`) or back:
    (send order as local chunk slots, send counts per rank, receive counts per rank, local slot of each
    received chunk)."""
    size, rank = layout.size, layout.rank
    zig = {r: list(layout.chunks_of(r)) for r in range(size)}
    seg = {r: [2 * r, 2 * r + 1] for r in range(size)}
    held, want = (zig, seg) if forward else (seg, zig)
    owner_held = {j: r for r, js in held.items() for j in js}
    owner_want = {j: r for r, js in want.items() for j in js}
    send = sorted(held[rank], key=lambda j: (owner_want[j], j))
    recv = sorted(want[rank], key=lambda j: (owner_held[j], j))
    send_counts = [sum(owner_want[j] == r for j in send) for r in range(size)]
    recv_counts = [sum(owner_held[j] == r for j in recv) for r in range(size)]
    return ([held[rank].index(j) for j in send], send_counts, recv_counts, [recv.index(j) for j in want[rank]])


def _exchange(x: torch.Tensor, layout: ZigzagLayout, forward: bool, group) -> torch.Tensor:
    c = layout.chunk
    send, send_counts, recv_counts, arrange = _chunk_plan(layout, forward)
    chunks = x.unflatten(1, (2, c))
    inp = chunks[:, send].flatten(1, 2).transpose(0, 1).contiguous()  # [2c, B, ...]: the token dim first
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, [n * c for n in recv_counts], [n * c for n in send_counts], group=group)
    return out.transpose(0, 1).unflatten(1, (2, c))[:, arrange].flatten(1, 2)


class _Relayout(torch.autograd.Function):
    """[B, 2c, ...] between the zigzag layout and this rank's contiguous segment (all-to-all); the backward
    moves the gradient the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: ZigzagLayout, to_segment: bool, group) -> torch.Tensor:
        ctx.layout, ctx.to_segment, ctx.group = layout, to_segment, group
        return _exchange(x, layout, to_segment, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.layout, not ctx.to_segment, ctx.group), None, None, None


def torch_segment_kda(q, k, v, g, beta, layout: ZigzagLayout, group, use_qk_l2norm: bool) -> torch.Tensor:
    """KDA over this rank's contiguous segment [1, 2c, ...] of `layout`, exact, in torch
    (`miles_k3.ops.kda_cp`): a zero-start pass, one all-gather of the ranks' (M, b), the scan, the
    correction."""
    o0, w, transition = segment_pass(
        q, k, v, g, beta, layout.segment_bounds_of(layout.rank), use_qk_l2norm=use_qk_l2norm
    )
    ranks = range(layout.size)
    states = start_states(
        _AllGather.apply(transition, group),
        [layout.continues(r) for r in ranks],
        [len(layout.segment_bounds_of(r)) == 2 for r in ranks],
    )
    return correct(o0, w, states[layout.rank]).to(v.dtype)


def fla_context(layout: ZigzagLayout, group, device: torch.device):
    """fla's CP context for `layout`'s contiguous segments: fla's 'contiguous' layout gives rank r tokens
    [r T / size, (r + 1) T / size) of the padded row, which are our segments."""
    from fla.ops.cp import build_cp_context  # lazy: needs triton + a GPU

    cu = torch.tensor(layout.bounds, dtype=torch.long)
    return build_cp_context(cu.to(device), group, cu_seqlens_cpu=cu, layout="contiguous")


def fla_segment_kda(q, k, v, g, beta, context, use_qk_l2norm: bool) -> torch.Tensor:
    """fla's chunk_kda on this rank's segment, the cross-rank state pass inside fla (`context` from
    `fla_context`)."""
    from fla.ops.kda import chunk_kda

    o, _ = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=use_qk_l2norm, cp_context=context)
    return o.to(v.dtype)


class MegatronCP(ContextParallel):
    """The CP share of this rank in megatron's context-parallel group, with its collectives.

    A forward runs inside `sharded(layout)`, which hands the mixers the row's layout; the model is called
    with the rank's local tokens and no `cu_seqlens` (the layout carries the boundaries) and no decode cache.
    KDA's recurrence runs in fla's CP kernels on CUDA and in the exact torch pieces elsewhere (the CUDA test
    compares the two through `torch_segment_kda`)."""

    def __init__(self):
        if not ps.model_parallel_is_initialized():
            raise ValueError("megatron's parallel state is not initialized: call init_parallel(..., cp_size)")
        super().__init__(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
        self.group = ps.get_context_parallel_group()
        self.layout: ZigzagLayout | None = None
        self._fla: tuple[ZigzagLayout, object] | None = None  # fla's CP context of the current layout

    def split(self, num_tokens: int, cu_seqlens: torch.Tensor | None) -> ZigzagLayout:
        """This rank's layout of a packed row of `num_tokens` tokens (sequences `cu_seqlens`, None = one)."""
        return ZigzagLayout.split(num_tokens, cu_seqlens, self.size, self.rank)

    @contextlib.contextmanager
    def sharded(self, layout: ZigzagLayout) -> Iterator[None]:
        """The model's forwards inside this block run on `layout`'s local tokens (the backward needs no
        layout: each collective keeps what it used)."""
        if (layout.size, layout.rank) != (self.size, self.rank):
            raise ValueError(
                f"layout is for rank {layout.rank} of {layout.size}, this is rank {self.rank} of {self.size}"
            )
        before, self.layout = self.layout, layout
        try:
            yield
        finally:
            self.layout = before

    def _current(self, x: torch.Tensor) -> ZigzagLayout:
        if self.layout is None:
            raise ValueError(
                "a context-parallel forward runs inside `cp.sharded(layout)` (megatron_patches.context_parallel)"
            )
        if x.shape[0] != 1 or x.shape[1] != self.layout.local_len:
            raise ValueError(
                f"context parallelism takes one packed row of this rank's {self.layout.local_len} "
                f"tokens ([1, {self.layout.local_len}]), got a tensor of shape {tuple(x.shape)}"
            )
        return self.layout

    @staticmethod
    def _training_only(cu_seqlens, *states) -> None:
        if cu_seqlens is not None:
            raise ValueError(
                "under context parallelism the layout carries the sequence boundaries: call the "
                "model without cu_seqlens"
            )
        if any(s is not None and s is not False for s in states):
            raise ValueError("context parallelism runs training forwards only: no decode cache")

    # --- KDA ---

    def to_segment(self, x: torch.Tensor) -> torch.Tensor:
        return _Relayout.apply(x, self._current(x), True, self.group)

    def to_zigzag(self, x: torch.Tensor) -> torch.Tensor:
        return _Relayout.apply(x, self._current(x), False, self.group)

    def short_conv(self, x, weight, *, state, cu_seqlens):
        self._training_only(cu_seqlens, state)
        layout = self._current(x)
        width = weight.shape[-1] - 1
        if layout.local_len < width:
            raise ValueError(
                f"context parallelism needs at least {width} tokens per rank (the short conv's "
                f"history), got {layout.local_len}"
            )
        # every rank's last W-1 inputs; rank r reads rank r-1's (rank 0 a zero row: no earlier segment)
        tails = _AllGather.apply(x[0, x.shape[1] - width :], self.group)
        prev = torch.cat([torch.zeros_like(tails[:1]), tails[:-1]])[self.rank]
        bounds = layout.segment_bounds_of(self.rank)
        state = halo_state(prev, layout.segment[0], layout.segment_start_of_sequence(self.rank), len(bounds) - 1)
        return segment_conv(x, weight, bounds, state), None

    def short_convs(self, xs, weights, *, states, cu_seqlens):
        return [self.short_conv(x, w, state=s, cu_seqlens=cu_seqlens) for x, w, s in zip(xs, weights, states)]

    def kda(self, q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
        self._training_only(cu_seqlens, initial_state, output_final_state)
        layout = self._current(q)
        if q.is_cuda:
            if self._fla is None or self._fla[0] is not layout:
                self._fla = layout, fla_context(layout, self.group, q.device)
            return fla_segment_kda(q, k, v, g, beta, self._fla[1], use_qk_l2norm), None
        return torch_segment_kda(q, k, v, g, beta, layout, self.group, use_qk_l2norm), None

    # --- MLA ---

    def mla_keys(self, latent, rope, mask):
        self._training_only(None, mask)
        layout = self._current(latent)
        kv = _AllGather.apply(torch.cat([latent[0], rope[0]], dim=-1), self.group)  # [size, 2c, R + Dr]
        kv = kv.flatten(0, 1)[layout.row_order.to(kv.device)][None]  # [1, padded, R + Dr] in row order
        latent, rope = kv.split([latent.shape[-1], rope.shape[-1]], dim=-1)
        # which keys each local query sees, as positions and sequence ids (no [2c, padded] tensor)
        seq = layout.sequence_ids
        mask = SegmentCausalMask(layout.positions, torch.arange(layout.padded), seq[layout.positions], seq)
        return latent, rope, mask

    # --- results ---

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the CP group of a per-rank value (no autograd: for the loss's reported value)."""
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x

    def gather_tokens(self, x: torch.Tensor, layout: ZigzagLayout, dim: int = 1) -> torch.Tensor:
        """Every rank's local per-token values (2c along `dim`) -> the row's N values in order (no autograd)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.detach().contiguous(), group=self.group)
        return layout.unshard(parts, dim)
