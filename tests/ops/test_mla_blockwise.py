"""The memory-efficient MLA attention core (`miles_k3.ops.mla`): the blockwise online softmax and its
recomputing backward equal the dense softmax over the explicit [T, S] mask (fp64, 1e-12) for every mask form
the model uses (plain causal, a decode-style suffix, packed rows, a context-parallel rank's zigzag queries),
it saves no [T, S] tensor for backward, and the dispatch sends long rows there."""

from __future__ import annotations

import pytest
import torch

import miles_k3.ops.mla as mla
from miles_k3.ops.mla import SegmentCausalMask, blockwise_attention, mla_attention, packed_causal_attention


def _leaves(t: int, s: int, seed: int, heads: int = 2, dqk: int = 6, dv: int = 4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, heads, dqk, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, s, heads, dqk, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, s, heads, dv, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(1, t, heads, dv, generator=g, dtype=torch.float64)
    return [q, k, v], up


def _explicit(q, k, v, scale, mask):
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", p, v)


def _value_and_grads(fn, leaves, up):
    for x in leaves:
        x.grad = None
    out = fn(*leaves)
    (out * up).sum().backward()
    return [out.detach(), *(x.grad.clone() for x in leaves)]


def _zigzag_mask(bounds: list[int], size: int, rank: int) -> SegmentCausalMask:
    # a CP rank's queries (chunks r and 2 size - 1 - r of the row) over the whole row's keys
    whole = SegmentCausalMask.packed(bounds)
    c = bounds[-1] // (2 * size)
    pos = torch.cat([torch.arange(j * c, (j + 1) * c) for j in (rank, 2 * size - 1 - rank)])
    return SegmentCausalMask(pos, whole.k_pos, whole.q_seg[pos], whole.k_seg)


MASKS = {
    "causal": lambda: SegmentCausalMask.causal(13, 13),
    "suffix": lambda: SegmentCausalMask.causal(5, 13),
    "packed": lambda: SegmentCausalMask.packed([0, 2, 2, 7, 8, 13]),
    "zigzag": lambda: _zigzag_mask([0, 5, 11, 16], size=2, rank=1),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("block", [1, 3, 4, 64])
def test_blockwise_equals_dense_softmax_in_value_and_gradient(name, block):
    mask = MASKS[name]()
    leaves, up = _leaves(len(mask.q_pos), len(mask.k_pos), seed=block)
    want = _value_and_grads(lambda q, k, v: _explicit(q, k, v, 0.37, mask.dense()), leaves, up)
    got = _value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, 0.37, mask, block=block), leaves, up)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_blockwise_saves_no_scores_for_backward():
    """Only q, k, v, the output and the [B, H, T] log-normalizer are kept: nothing of T x S."""
    mask = SegmentCausalMask.causal(40, 40)
    leaves, _ = _leaves(40, 40, seed=0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        blockwise_attention(*leaves, 0.5, mask, block=8)
    assert saved and max(t.numel() for t in saved) <= 40 * 2 * 6
    assert not any(t.shape[-2:] == (40, 40) for t in saved)


def test_plan_skips_key_blocks_no_query_sees():
    """Causal rows skip the blocks above the diagonal; packed rows also skip other sequences' blocks."""
    causal = SegmentCausalMask.causal(12, 12).plan(4)
    assert [len(keys) for _, keys in causal] == [1, 2, 3]
    packed = SegmentCausalMask.packed([0, 4, 8, 12]).plan(4)
    assert [[k.start for k in keys] for _, keys in packed] == [[0], [4], [8]]


def test_long_rows_take_the_blockwise_path(monkeypatch):
    """mla_attention / packed_causal_attention on CPU past DENSE_MAX_KEYS run blockwise, with the results of
    the dense path (fp64)."""
    monkeypatch.setattr(mla, "DENSE_MAX_KEYS", 4)
    monkeypatch.setattr(mla, "BLOCK", 4)
    calls = []
    real = mla._BlockwiseAttention.apply
    monkeypatch.setattr(mla._BlockwiseAttention, "apply", lambda *a: calls.append(a[-1]) or real(*a))
    leaves, up = _leaves(13, 13, seed=5)
    cu = torch.tensor([0, 6, 13])
    got = _value_and_grads(lambda q, k, v: packed_causal_attention(q, k, v, 0.4, cu), leaves, up)
    want = _value_and_grads(
        lambda q, k, v: _explicit(q, k, v, 0.4, SegmentCausalMask.packed([0, 6, 13]).dense()), leaves, up
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    got = _value_and_grads(lambda q, k, v: mla_attention(q, k, v, 0.4, None), leaves, up)
    want = _value_and_grads(lambda q, k, v: _explicit(q, k, v, 0.4, mla.causal_mask(13, 13, "cpu")), leaves, up)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert calls == [4, 4]


def test_bf16_inputs_compute_in_fp32_and_return_bf16():
    mask = SegmentCausalMask.causal(9, 9)
    leaves, _ = _leaves(9, 9, seed=2)
    q, k, v = (x.detach().to(torch.bfloat16) for x in leaves)
    got = blockwise_attention(q, k, v, 0.5, mask, block=4)
    assert got.dtype == torch.bfloat16
    want = _explicit(q.double(), k.double(), v.double(), 0.5, mask.dense())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)


def test_bad_inputs_name_the_problem():
    mask = SegmentCausalMask.causal(4, 4)
    leaves, _ = _leaves(5, 5, seed=0)
    with pytest.raises(ValueError, match="mask is for 4 queries x 4 keys"):
        blockwise_attention(*leaves, 0.5, mask)
    with pytest.raises(ValueError, match="block must be >= 1"):
        blockwise_attention(*leaves, 0.5, SegmentCausalMask.causal(5, 5), block=0)
