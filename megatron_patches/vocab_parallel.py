"""The vocabulary split over the TP group: embedding, logits and the trainer's log-probs / entropy.

    logp, entropy = token_logprobs(policy, hidden, targets, temperature, with_entropy=True)

hidden [M, D] are the final-normed hidden states that predict `targets` [M]; logp [M] (fp32, or fp64 for an
fp64 model) carries the gradient, entropy [M] is detached (a metric).

Layout (TP = t ranks, vocabulary V, rank r holds rows [r V/t, (r+1) V/t), megatron's `VocabUtility` split):
- `VocabParallelEmbedding`: megatron's own (it runs on CPU as shipped): each rank looks up the ids in its
  rows, others give 0, and the outputs are summed over TP. Frozen weight [V/t, D]. `tied_logits(h)` is
  the tied head: h @ E_local^T, this rank's vocab slice of the logits.
- the untied head is a `ColumnLinear`: this rank's vocab slice of the logits.
- `token_logprobs` reads the local logits chunk by chunk over tokens ([chunk, V/t] at a time) and reduces
  the log-softmax over the TP group (a max, then one sum of [exp sum, target logit, sum p z] per chunk), so
  no rank holds [M, V] logits. Its gradient is the exact softmax gradient, computed per chunk with no
  collective of its own in backward: each chunk keeps only its hidden rows and [chunk] log-normalizer and
  computes its logits again there (nothing of [M, V/t] is held from forward to backward: 10 GiB of bf16
  logits at 32k tokens otherwise); the hidden states' gradient is all-reduced where it always is, in the
  head's own backward (megatron's copy-to region). TP = 1 is the same computation with a group of one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import VocabParallelEmbedding as _MegatronVocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from megatron_patches.linears import ColumnLinear, _no_init
from miles_k3.ops import exact

DEFAULT_CHUNK = 4096  # tokens per chunk: [chunk, V/t] logits at a time


class VocabParallelEmbedding(_MegatronVocabParallelEmbedding):
    """megatron's vocab-parallel embedding, frozen: `weight` [V/t, D] holds rows
    [vocab_start_index, vocab_end_index) (the TP slice of `model.embed_tokens.weight` along dim 0)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, config: ModelParallelConfig):
        super().__init__(num_embeddings, embedding_dim, init_method=_no_init, config=config)
        self.weight.requires_grad_(False)

    def tied_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., D] -> this rank's logits [.., V/t] of the tied head (backward: hidden's gradient
        summed over TP, since each rank's slice of the logits depends on all of hidden)."""
        if self.tp_group.size() > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        return hidden @ self.weight.t()


def local_head(policy):
    """(logits_fn, vocab_start, group) of the policy's head: logits_fn(h [.., D]) gives the logits of vocab
    ids [vocab_start, vocab_start + width); `group` is the TP group they are split over, None if whole."""
    if policy.config.tie_word_embeddings:
        emb = policy.model.embed_tokens
        if isinstance(emb, VocabParallelEmbedding) and emb.tp_group.size() > 1:
            return emb.tied_logits, emb.vocab_start_index, emb.tp_group
        return (lambda h: h @ emb.weight.t()), 0, None
    head = policy.lm_head
    if isinstance(head, ColumnLinear) and head.tp.size > 1:
        return head, head.tp.rank * (policy.config.vocab_size // head.tp.size), head.tp.group
    return head, 0, None


def token_logprobs(
    policy,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    recompute_logits: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target) at `temperature` for each row of hidden [M, D] (and the entropy of pi), from the
    policy's (vocab-parallel or whole) head, `chunk_size` tokens at a time. Every rank of the TP group
    calls it with the same hidden and targets and gets the same result. `recompute_logits`: see
    `vocab_parallel_logprobs` (the head's LoRA dropout, if any, is replayed from `policy.lora_generator`)."""
    logits_fn, start, group = local_head(policy)
    return vocab_parallel_logprobs(
        logits_fn,
        hidden,
        targets,
        temperature,
        vocab_start=start,
        group=group,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
        recompute_logits=recompute_logits,
        generator=getattr(policy, "lora_generator", None),
    )


def vocab_parallel_logprobs(
    logits_fn,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    vocab_start: int = 0,
    group=None,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    recompute_logits: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` for any head: logits_fn(h [c, D]) -> [c, V_local] logits of ids
    [vocab_start, vocab_start + V_local), split over `group` (None: the whole vocabulary).

    recompute_logits (the trainer's): each chunk keeps only its hidden rows and [c] log-normalizer for
    backward and runs logits_fn again there (one more head matmul per chunk, no [c, V_local] logits held
    between forward and backward); the head's trainable parameters (a LoRA on lm_head) get their gradients
    accumulated in that backward, as reentrant checkpointing does, so call `.backward()` rather than
    `torch.autograd.grad` on them. `generator`: the one logits_fn draws dropout masks from, replayed there.
    False: each chunk saves its logits in the head's dtype (the earlier path, for the benchmarks)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [M, D] and targets [M], got {tuple(hidden.shape)} / {tuple(targets.shape)}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    logps, entropies = [], []
    for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size)):
        if recompute_logits:
            logp, entropy = _RecomputedLogSoftmax.apply(
                h, t, logits_fn, generator, vocab_start, float(temperature), group
            )
        else:
            logp, entropy = _ShardedLogSoftmax.apply(logits_fn(h), t, vocab_start, float(temperature), group)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:  # no tokens
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


def _reduce(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, temperature: float, group):
    """Forward of the sharded log-softmax of local logits z [c, V_local]: two all-reduces over `group`.
    Returns (logp, entropy, lse, idx, mine): lse [c] the log-normalizer of z / T over the whole vocabulary,
    idx / mine where this rank's slice holds each target."""
    zf = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature  # [c, V_local]: one chunk's fp32
    m = zf.max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(zf - m[:, None])
    local = targets - vocab_start
    mine = (local >= 0) & (local < z.shape[-1])
    idx = torch.where(mine, local, 0)
    zt = torch.where(mine, zf.gather(-1, idx[:, None]).squeeze(-1), 0.0)
    sums = torch.stack([e.sum(-1), zt, (e * zf).sum(-1)])  # [3, c]: partial over this rank's vocab slice
    if group is not None:
        dist.all_reduce(sums, group=group)
    s, zt, ez = sums
    lse = m + s.log()
    logp = zt - lse
    if exact.enabled() and group is None:  # exact mode: the engine's log_softmax at the token, bit for bit
        logp = torch.log_softmax(zf, dim=-1).gather(-1, idx[:, None]).squeeze(-1)
    return logp, lse - ez / s, lse, idx, mine


def _logits_grad(z, lse, idx, mine, grad_logp, temperature: float) -> torch.Tensor:
    """d logp / dz for local logits z [c, V_local]: g (onehot(target) - p) / T, in z's dtype (no collective)."""
    zf = z.to(lse.dtype) / temperature
    grad = -torch.exp(zf - lse[:, None]) * grad_logp[:, None]
    grad.scatter_add_(-1, idx[:, None], torch.where(mine, grad_logp, 0.0)[:, None])
    return (grad / temperature).to(z.dtype)


class _ShardedLogSoftmax(torch.autograd.Function):
    """(z [c, V_local] local logits, targets [c]) -> (log softmax(z / T)[target], entropy), softmax over the
    whole vocabulary (the group's slices). Forward: two all-reduces; backward: local only,
    dz = g (onehot(target) - p) / T. Saves z in its own dtype and the [c] log-normalizer."""

    @staticmethod
    def forward(ctx, z, targets, vocab_start: int, temperature: float, group):
        logp, entropy, lse, idx, mine = _reduce(z, targets, vocab_start, temperature, group)
        ctx.save_for_backward(z, lse, idx, mine)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        z, lse, idx, mine = ctx.saved_tensors
        return _logits_grad(z, lse, idx, mine, grad_logp, ctx.temperature), None, None, None, None


class _RecomputedLogSoftmax(torch.autograd.Function):
    """`_ShardedLogSoftmax` of logits_fn(h) for h [c, D] that saves h and the [c] log-normalizer, not the
    logits: the backward runs logits_fn(h) again (the dropout `generator` set back to its forward state and
    restored after), takes dz locally and backpropagates it through the head, which gives h's gradient (the
    head's own backward all-reduces it over TP, as without recompute) and accumulates its parameters'."""

    @staticmethod
    def forward(ctx, h, targets, logits_fn, generator, vocab_start: int, temperature: float, group):
        ctx.rng = None if generator is None else generator.get_state()
        logp, entropy, lse, idx, mine = _reduce(logits_fn(h), targets, vocab_start, temperature, group)
        ctx.save_for_backward(h, lse, idx, mine)
        ctx.logits_fn, ctx.generator, ctx.temperature = logits_fn, generator, temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        h, lse, idx, mine = ctx.saved_tensors
        generator = ctx.generator
        now = None if generator is None else generator.get_state()
        if generator is not None:
            generator.set_state(ctx.rng)
        try:
            with torch.enable_grad():
                leaf = h.detach().requires_grad_(ctx.needs_input_grad[0])
                z = ctx.logits_fn(leaf)
        finally:
            if generator is not None:
                generator.set_state(now)
        if z.requires_grad:
            torch.autograd.backward(z, _logits_grad(z.detach(), lse, idx, mine, grad_logp, ctx.temperature))
        return leaf.grad, None, None, None, None, None, None
