"""Routing with one expert per token, against hand-computed weights: K3's published gate renormalizes the
chosen scores only when top_k > 1, so a single expert keeps its raw sigmoid score (times the routed scaling
factor, which applies whatever k). The Triton kernel's side of the same case is in test_kernels_router.py."""

import math

import pytest
import torch

from miles_k3.model import K3Config
from miles_k3.model.moe import Router
from miles_k3.ops.router import route_tokens

LOGITS = torch.tensor([[0.0, 2.0, -1.0, 1.0], [3.0, -2.0, 0.5, 0.0]])
BIAS = torch.tensor([0.0, -0.5, 0.0, 0.8])


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.446])
def test_top1_keeps_the_raw_score_times_the_scaling_factor(renormalize, scale):
    # choice = sigmoid + bias: row 0 (0.5, 0.381, 0.269, 1.531) -> expert 3; row 1 (0.953, -0.381, 0.622, 1.3) -> 3
    w, idx = route_tokens(LOGITS, BIAS, 1, renormalize=renormalize, scaling_factor=scale)
    assert idx.tolist() == [[3], [3]]
    torch.testing.assert_close(w, torch.tensor([[sigmoid(1.0)], [sigmoid(0.0)]]) * scale, rtol=1e-6, atol=0)


def test_top2_still_renormalizes():
    w, idx = route_tokens(LOGITS, BIAS, 2, renormalize=True, scaling_factor=2.446)
    order = idx.sort(-1)
    assert order.values.tolist() == [[0, 3], [0, 3]]
    s0, s1 = (sigmoid(0.0), sigmoid(1.0)), (sigmoid(3.0), sigmoid(0.0))
    want = torch.tensor([[s / sum(s0) for s in s0], [s / sum(s1) for s in s1]]) * 2.446
    torch.testing.assert_close(w.gather(1, order.indices), want, rtol=1e-6, atol=0)


def test_the_config_scaling_reaches_a_top1_gate():
    """`moe_renormalize` (HF `norm_topk_prob` / `moe_renormalize`) and `routed_scaling_factor` as the model's gate
    applies them: a top-1 config gets sigmoid(logit) * routed_scaling_factor."""
    c = K3Config.from_preset("k3-tiny").replace(
        num_experts_per_token=1, num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446
    )
    gate = Router(c)
    with torch.no_grad():
        gate.weight.normal_(generator=torch.Generator().manual_seed(0))
        if gate.e_score_correction_bias is not None:
            gate.e_score_correction_bias.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(1))
        x = torch.randn(5, c.hidden_size, generator=torch.Generator().manual_seed(2))
        w, idx = gate(x)
    logits = x @ gate.weight.T
    torch.testing.assert_close(w, logits.gather(1, idx).sigmoid() * 2.446, rtol=1e-5, atol=1e-6)
