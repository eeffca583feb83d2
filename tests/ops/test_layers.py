"""Ops against independent references: fla's naive_attnres, the published SiTU / router / norm formulas."""

import math

import pytest
import torch

from miles_k3.ops.attnres import attn_res_mix
from miles_k3.ops.glu import glu, situ_glu
from miles_k3.ops.mla import causal_mask, mla_attention, packed_causal_attention
from miles_k3.ops.norm import gated_rms_norm, rms_norm
from miles_k3.ops.router import route_tokens


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("num_blocks", [0, 1, 5])
def test_attn_res_mix_matches_fla_naive_attnres(num_blocks):
    from fla.ops.attnres import naive_attnres

    g = gen(num_blocks)
    d = 24
    blocks = [torch.randn(2, 7, d, generator=g) * (i + 1) for i in range(num_blocks)]
    h = torch.randn(2, 7, d, generator=g)
    norm_w = torch.rand(d, generator=g) + 0.5
    proj_w = torch.randn(1, d, generator=g)
    want = naive_attnres(proj_w[0], [*blocks, h], norm_w, rms_eps=1e-5)
    got = attn_res_mix(h, blocks, norm_w, proj_w, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_attn_res_mix_zero_query_is_uniform_average():
    blocks = [torch.randn(3, 8) for _ in range(3)]
    h = torch.randn(3, 8)
    got = attn_res_mix(h, blocks, torch.ones(8), torch.zeros(1, 8), 1e-5)
    torch.testing.assert_close(got, torch.stack([*blocks, h]).mean(0))


def test_situ_glu_published_formula_scalar():
    # beta tanh(g / beta) sigmoid(g) * beta_lin tanh(u / beta_lin), evaluated with Python floats
    for gv, uv in [(0.3, -1.2), (7.0, 40.0), (-9.0, 3.0)]:
        want = 4 * math.tanh(gv / 4) / (1 + math.exp(-gv)) * 25 * math.tanh(uv / 25)
        got = situ_glu(torch.tensor([gv]), torch.tensor([uv]))
        assert abs(got.item() - want) <= 1e-5 * max(1.0, abs(want))


def test_situ_is_soft_capped_and_computed_in_fp32():
    g = torch.tensor([1e4, -1e4], dtype=torch.bfloat16)
    out = situ_glu(g, torch.tensor([1e4, 1e4], dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.tensor([100.0, 0.0]), rtol=1e-2, atol=1e-2)


def test_glu_rejects_unknown_activation():
    with pytest.raises(ValueError, match="gelu"):
        glu(torch.ones(1), torch.ones(1), "gelu")


def test_router_selects_with_bias_but_weights_from_raw_scores():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # forces expert 3 into the selection
    w, idx = route_tokens(logits, bias, 2, renormalize=True, scaling_factor=2.0)
    order = idx[0].argsort()
    idx, w = idx[0][order], w[0][order]
    assert idx.tolist() == [0, 3]
    s = torch.sigmoid(torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(w, 2.0 * s / s.sum())


def test_router_group_limited_selection():
    # sigmoid scores; groups of 2 ranked by their top-2 sum: g0 = s(5)+s(-5) = 1.0, g1 = 2 s(1) = 1.46,
    # g2 = s(4.9)+s(-9) = 0.99, g3 = 2 s(2) = 1.76 -> keep g1, g3; the global top-2 (experts 0, 4) is excluded
    logits = torch.tensor([[5.0, -5.0, 1.0, 1.0, 4.9, -9.0, 2.0, 2.0]])
    w, idx = route_tokens(logits, None, 2, num_groups=4, topk_group=2, renormalize=False)
    assert sorted(idx[0].tolist()) == [6, 7]
    torch.testing.assert_close(w[0], torch.sigmoid(torch.tensor([2.0, 2.0])))


def test_rms_norms_match_formula():
    g = gen(1)
    x, gate, w = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g), torch.rand(16, generator=g)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want)
    torch.testing.assert_close(gated_rms_norm(x, gate, w, 1e-6), want * torch.sigmoid(gate))


def test_mla_attention_matches_explicit_softmax():
    g = gen(2)
    q, k = torch.randn(2, 5, 3, 12, generator=g), torch.randn(2, 9, 3, 12, generator=g)
    v = torch.randn(2, 9, 3, 8, generator=g)
    mask = causal_mask(5, 9, q.device)
    got = mla_attention(q, k, v, 0.3, mask)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * 0.3
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(got, torch.einsum("bhts,bshd->bthd", p, v), rtol=1e-5, atol=1e-6)


def test_packed_attention_equals_segment_masked_attention():
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 2, 7, 8, 13])
    q, k = torch.randn(2, 1, 13, 3, 8, generator=g)
    v = torch.randn(1, 13, 3, 5, generator=g)
    seg = torch.zeros(13, dtype=torch.long)
    seg[cu[1:-1]] = 1
    seg = seg.cumsum(0)
    mask = (seg[:, None] == seg[None, :]) & causal_mask(13, 13, q.device)  # independent [T, T] reference
    scores = torch.einsum("bthd,bshd->bhts", q, k) * 0.4
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(
        packed_causal_attention(q, k, v, 0.4, cu), torch.einsum("bhts,bshd->bthd", p, v), rtol=1e-5, atol=1e-6
    )


def test_packed_attention_gradients_and_empty_sequences():
    """The trainer backpropagates through packed attention; an empty sequence (repeated bound) is allowed."""
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 3, 3, 9])
    leaves = [torch.randn(1, 9, 2, d, generator=g, requires_grad=True) for d in (6, 6, 4)]
    up = torch.randn(1, 9, 2, 4, generator=g)
    (packed_causal_attention(*leaves, 0.5, cu) * up).sum().backward()
    got = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    outs = [mla_attention(*(x[:, b:e] for x in leaves), 0.5, None) for b, e in [(0, 3), (3, 9)]]
    (torch.cat(outs, 1) * up).sum().backward()
    for a, x in zip(got, leaves):
        torch.testing.assert_close(a, x.grad, rtol=1e-5, atol=1e-6)
