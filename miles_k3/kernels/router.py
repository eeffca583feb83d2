"""The sigmoid router's selection in one kernel: scores, biased choice, top-k, gather and renormalization.

The torch definition (`miles_k3.ops.router.route_tokens`) runs sigmoid, the bias add, topk, gather, sum, the
epsilon add and the division as seven kernels per MoE layer on CUDA, all on a [N, E] row of a few dozen
floats. This reads each token's logits once and writes its k weights and expert indices, one kernel.

Contract of `route(logits, bias, top_k, renormalize, scaling_factor)` (`supports` says which calls qualify;
`route_tokens` sends the others, and every grouped selection (num_groups > 1), to the definition):
- logits [N, E] fp32, rows contiguous; bias [E] (any float dtype, added in fp32 as the definition does) or
  None; 1 <= top_k <= E.
- returns (weights [N, k] fp32, indices [N, k] int64), both new and contiguous. Selection as the
  definition's: the k largest of sigmoid(logits) + bias, ties to the lower expert index; the order of the k
  within a row is by decreasing choice (the definition's topk is unsorted: consumers depend on the set).
  Weights: sigmoid(logit) of each chosen expert, divided by their sum + 1e-20 when `renormalize` and
  top_k > 1 (one expert keeps its raw score, as K3's gate does), times
  `scaling_factor` unless it is 1. sigmoid is Triton's (within an ulp or two of torch's), and the sum adds
  the k in another order, so weights match the definition to a few fp32 ulps, and a choice within that of
  another expert's may select differently. Rows with NaN logits are not defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 4096


@triton.jit
def _route(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    indices_ptr,
    experts,
    row_stride,
    scale,
    top_k,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < experts
    scores = tl.sigmoid(tl.load(logits_ptr + row * row_stride + offs, mask=ok, other=0.0).to(tl.float32))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    indices = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in range(top_k):  # the next largest choice, lowest index on ties; then out of the running
        best = tl.max(choice, axis=0)
        at = tl.min(tl.where(choice == best, offs, BLOCK_E), axis=0)
        picked = offs == at
        weights = tl.where(slots == j, tl.sum(tl.where(picked, scores, 0.0), axis=0), weights)
        indices = tl.where(slots == j, at.to(tl.int64), indices)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    if SCALE:
        weights = weights * scale
    kept = slots < top_k
    tl.store(weights_ptr + row * top_k + slots, weights, mask=kept)
    tl.store(indices_ptr + row * top_k + slots, indices, mask=kept)


def supports(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> bool:
    """Whether the kernel takes this call (module docstring); else the definition runs."""
    return (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.stride(-1) == 1
        and 1 <= top_k <= logits.shape[1] <= MAX_EXPERTS
        and (
            bias is None
            or (
                bias.shape == logits.shape[1:]
                and bias.is_floating_point()
                and bias.device == logits.device
                and bias.stride(0) == 1
            )
        )
    )


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] fp32, indices [N, k] int64) (module docstring)."""
    assert supports(logits, bias, top_k)
    n, e = logits.shape
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, indices
    _route[(n,)](
        logits,
        logits if bias is None else bias,
        weights,
        indices,
        e,
        logits.stride(0),
        float(scaling_factor),
        top_k,
        HAS_BIAS=bias is not None,
        RENORMALIZE=bool(renormalize) and top_k > 1,  # one expert keeps its raw score
        SCALE=scaling_factor != 1.0,
        BLOCK_E=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights, indices
