"""The context-parallel KDA pieces (miles_k3.ops.kda_cp) computed segment by segment equal the unsplit ops:
outputs and input gradients, fp64, packed rows whose sequences cross segment boundaries."""

import pytest
import torch

from miles_k3.ops.kda import kda, kda_gate
from miles_k3.ops.kda_cp import kda_split_reference, short_conv_split_reference, start_states
from miles_k3.ops.short_conv import causal_short_conv

H, K, V = 2, 8, 6


def _inputs(total: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, total, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, total, H, V, generator=g, dtype=torch.float64)
    gate = kda_gate(
        torch.randn(1, total, H * K, generator=g, dtype=torch.float64),
        torch.zeros(H),
        None,
        num_heads=H,
        form="lower_bound",
    ).double()
    beta = torch.rand(1, total, H, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


# 24 tokens: segments of 12 (size 2), 6 (size 4) and 3 (size 8). Cases: one sequence over every segment; a
# sequence that fits inside one segment between two that cross boundaries; boundaries on segment edges.
CASES = {"one-sequence": None, "packed": [0, 9, 11, 20, 24], "on-edges": [0, 6, 12, 13, 24]}


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_split_kda_equals_unsplit_kda(size, case):
    cu = None if CASES[case] is None else torch.tensor(CASES[case])
    inputs = _inputs(24)
    want = kda(*inputs, cu_seqlens=cu, use_qk_l2norm=True)[0]
    got = kda_split_reference(*inputs, cu_seqlens=cu, size=size)
    assert got.dtype == torch.float64
    assert float((got - want).detach().norm() / want.detach().norm()) < 1e-12
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g_want = torch.autograd.grad((want * probe).sum(), inputs)
    g_got = torch.autograd.grad((got * probe).sum(), inputs)
    for a, b in zip(g_got, g_want):
        assert float((a - b).norm() / b.norm()) < 1e-12


def test_split_without_state_hand_off_differs():
    """The correction matters: segments left at a zero start state give other outputs."""
    cu = torch.tensor(CASES["packed"])
    inputs = _inputs(24)
    want = kda(*inputs, cu_seqlens=cu, use_qk_l2norm=True)[0]
    alone = torch.cat(
        [
            kda(*(x[:, s : s + 12] for x in inputs), cu_seqlens=torch.tensor(b), use_qk_l2norm=True)[0]
            for s, b in ((0, [0, 9, 11, 12]), (12, [0, 8, 12]))
        ],
        dim=1,
    )
    assert float((alone - want).detach().norm() / want.detach().norm()) > 1e-3


def test_start_states_compose_in_rank_order():
    """Segment 2 of a sequence crossing segments 0..2 starts from M1 (M0 0 + b0) + b1; a boundary resets."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(3, 1, 2, 2 + 1, generator=g, dtype=torch.float64)
    m, b = t[..., :2], t[..., 2:]
    s = start_states(t, continues=[False, True, True], single=[True, True, True])
    assert torch.equal(s[0], torch.zeros_like(b[0]))
    assert torch.allclose(s[1], b[0]) and torch.allclose(s[2], m[1] @ b[0] + b[1])
    s = start_states(t, continues=[False, True, True], single=[True, False, True])
    assert torch.allclose(s[2], b[1])  # a sequence began inside segment 1
    assert torch.equal(start_states(t, [False, False, True], [True] * 3)[1], torch.zeros_like(b[0]))


@pytest.mark.parametrize("case", list(CASES))
def test_split_short_conv_equals_unsplit(case):
    cu = None if CASES[case] is None else torch.tensor(CASES[case])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 24, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64)
    for size in (2, 4):
        want = causal_short_conv(x, weight, cu_seqlens=cu)[0]
        got = short_conv_split_reference(x, weight, cu_seqlens=cu, size=size)
        assert float((got - want).detach().norm() / want.detach().norm()) < 1e-14
        probe = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (a,) = torch.autograd.grad((got * probe).sum(), x)
        (b,) = torch.autograd.grad((want * probe).sum(), x)
        assert float((a - b).norm() / b.norm()) < 1e-14


def test_split_short_conv_needs_the_history_on_one_segment():
    x, weight = torch.randn(1, 24, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match="shorter than the conv's history"):
        short_conv_split_reference(x, weight, cu_seqlens=None, size=12)
