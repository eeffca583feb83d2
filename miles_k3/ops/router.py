"""Sigmoid noaux_tc router: selection on scores + correction bias, weights from raw scores.

    s = sigmoid(x @ W^T)                         (fp32, fp64 for fp64 logits)
    choice = s + e_score_correction_bias         (selection only)
    groups: keep the topk_group groups whose top-2 choice scores sum highest
    idx = topk(choice within kept groups, k)
    w = s[idx]; w /= sum(w) + 1e-20 if renormalize and k > 1; w *= routed_scaling_factor

As K3's published gate (and Kimi-Linear's remote code): a single expert (k = 1) keeps its raw sigmoid score,
renormalizing it would make every weight 1. The scaling factor applies whatever k.

Without groups, where `miles_k3.kernels.use_kernels` says so, this runs as one Triton kernel
(`miles_k3.kernels.router`: one launch instead of seven at decode); this definition stays the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_k3.kernels import use_kernels
from miles_k3.ops import exact


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, D], weight [E, D] -> logits x W^T [N, E] in fp32 whatever the inputs' dtype (fp64 ones too, as
    transformers' router does): routing is decided on fp32 scores. A decode step's few rows run the few-rows
    kernel (`miles_k3.kernels.few_rows_linear`: bf16 x read as it is, no upcast copy, no fp32 GEMM launch)
    where `use_kernels` says so; this is the definition."""
    if use_kernels(x):
        from miles_k3.kernels import few_rows_linear as kernels  # imported here: CPU installs never load triton

        if kernels.supports(x, weight, torch.float32):
            return kernels.linear(x, weight, torch.float32)
    return F.linear(x.float(), weight.float())


def route_tokens(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    *,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, k] fp32 (fp64 for fp64 logits), indices [N, k] int64)."""
    if num_groups == 1 and use_kernels(router_logits):
        from miles_k3.kernels import router as kernels  # imported here: CPU installs never load triton

        if kernels.supports(router_logits, correction_bias, top_k):
            return kernels.route(router_logits, correction_bias, top_k, renormalize, scaling_factor)
    n, e = router_logits.shape
    scores = router_logits.to(torch.promote_types(router_logits.dtype, torch.float32)).sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
    if num_groups > 1:
        grouped = choice.view(n, num_groups, e // num_groups)
        group_scores = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)
    indices = choice.topk(top_k, dim=-1, sorted=False).indices
    if exact.enabled():  # the experts in id order, so the weights' sum has one order however they were found
        indices = indices.sort(dim=-1).values  # (a replayed routing's bonus reorders what topk returns)
    weights = scores.gather(1, indices)
    if renormalize and top_k > 1:  # one expert keeps its raw score (module docstring)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if scaling_factor != 1.0:  # x * 1.0 is x: skipping it saves a kernel per MoE layer at decode
        weights = weights * scaling_factor
    return weights, indices
