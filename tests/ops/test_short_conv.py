"""CPU tests for miles_k3.ops.short_conv."""

import pytest
import torch
import torch.nn.functional as F

from miles_k3.ops.short_conv import causal_short_conv, causal_short_convs

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def conv1d_reference(x, weight, state, activation="silu"):
    """F.conv1d with groups=D over the state-prefixed (or zero left-padded) input."""
    B, T, D = x.shape
    W = weight.shape[-1]
    xt = x.float().transpose(1, 2)
    xx = torch.cat([state.float(), xt], -1) if state is not None else F.pad(xt, (W - 1, 0))
    y = F.conv1d(xx, weight.float().view(D, 1, W), groups=D).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_matches_conv1d(activation, W):
    B, T, D = 2, 9, 6
    x, weight, state = torch.randn(B, T, D), torch.randn(D, W), torch.randn(B, D, W - 1)
    y, s = causal_short_conv(x, weight, activation=activation)
    torch.testing.assert_close(y, conv1d_reference(x, weight, None, activation), **TOL)
    torch.testing.assert_close(s, x[:, T - (W - 1) :].transpose(1, 2) if W > 1 else x[:, :0].transpose(1, 2))
    y, _ = causal_short_conv(x, weight, state=state, activation=activation)
    torch.testing.assert_close(y, conv1d_reference(x, weight, state, activation), **TOL)


def test_hf_conv1d_layout():
    """HF models hold nn.Conv1d(D, D, W, groups=D, padding=W-1) and keep the first T outputs."""
    B, T, D, W = 2, 7, 5, 4
    conv = torch.nn.Conv1d(D, D, W, groups=D, padding=W - 1, bias=False)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        ref = F.silu(conv(x.transpose(1, 2))[..., :T]).transpose(1, 2)
        y, _ = causal_short_conv(x, conv.weight)  # [D, 1, W]
    torch.testing.assert_close(y, ref, **TOL)


def test_streaming_matches_full():
    """Prefill in uneven pieces (some shorter than W-1), then token-by-token decode."""
    B, T, D, W = 2, 13, 4, 4
    x, weight, state0 = torch.randn(B, T, D), torch.randn(D, W), torch.randn(B, D, W - 1)
    y_full, s_full = causal_short_conv(x, weight, state=state0)
    ys, s = [], state0
    for a, b in [(0, 2), (2, 3), (3, 8)] + [(t, t + 1) for t in range(8, T)]:
        y, s = causal_short_conv(x[:, a:b], weight, state=s)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_full, **TOL)
    torch.testing.assert_close(s, s_full, rtol=0, atol=0)


def test_short_input_state_reaches_back():
    D, W = 3, 4
    state = torch.randn(1, D, W - 1)
    x = torch.randn(1, 1, D)
    _, s = causal_short_conv(x, torch.randn(D, W), state=state)
    torch.testing.assert_close(s, torch.cat([state[..., 1:], x.transpose(1, 2)], -1), rtol=0, atol=0)


def test_varlen_resets_per_segment():
    D, W = 5, 4
    lens = [3, 0, 7, 2]
    cu = torch.tensor([0] + lens).cumsum(0)
    N, T = len(lens), sum(lens)
    x, weight, state = torch.randn(1, T, D), torch.randn(D, W), torch.randn(N, D, W - 1)
    for st in (state, None):
        y, s = causal_short_conv(x, weight, state=st, cu_seqlens=cu)
        assert s.shape == (N, D, W - 1)
        for i in range(N):
            seg = slice(int(cu[i]), int(cu[i + 1]))
            y_i, s_i = causal_short_conv(x[:, seg], weight, state=None if st is None else st[i : i + 1])
            torch.testing.assert_close(y[:, seg], y_i, **TOL)
            torch.testing.assert_close(s[i : i + 1], s_i, rtol=0, atol=0)
    # changing segment 0 must not leak into segment 2
    x2 = x.clone()
    x2[:, :3] += 10.0
    y1, _ = causal_short_conv(x, weight, state=state, cu_seqlens=cu)
    y2, _ = causal_short_conv(x2, weight, state=state, cu_seqlens=cu)
    assert not torch.equal(y2[:, :3], y1[:, :3])
    torch.testing.assert_close(y2[:, 3:], y1[:, 3:], rtol=0, atol=0)


def test_varlen_gradients_equal_per_segment():
    """The trainer backpropagates through packed sequences: input, weight and state gradients equal the
    per-segment forwards' (the packed path splices states in with index copies)."""
    D, W = 4, 4
    lens = [5, 1, 0, 6]
    cu = torch.tensor([0] + lens).cumsum(0)
    g = torch.Generator().manual_seed(1)
    x, weight, state = (
        torch.randn(*shape, generator=g) for shape in ((1, sum(lens), D), (D, W), (len(lens), D, W - 1))
    )
    upstream = torch.randn(1, sum(lens), D, generator=g)
    packed = [t.clone().requires_grad_() for t in (x, weight, state)]
    y, s = causal_short_conv(packed[0], packed[1], state=packed[2], cu_seqlens=cu)
    ((y * upstream).sum() + s.square().sum()).backward()
    split = [t.clone().requires_grad_() for t in (x, weight, state)]
    loss = 0
    for i in range(len(lens)):
        seg = slice(int(cu[i]), int(cu[i + 1]))
        y_i, s_i = causal_short_conv(split[0][:, seg], split[1], state=split[2][i : i + 1])
        loss = loss + (y_i * upstream[:, seg]).sum() + s_i.square().sum()
    loss.backward()
    for a, b in zip(packed, split):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_state", [True, False])
def test_a_packed_group_runs_stacked_and_equals_its_members_bit_for_bit(with_state):
    """A KDA layer's q, k, v convs over packed rows run as one call over their stacked channels
    (`causal_short_convs`): outputs, final states and the input and state gradients equal the separate calls
    exactly; the weight gradient (a sum over tokens, of a frozen weight in LoRA training) up to rounding."""
    widths, W, lens = [4, 6, 4], 4, [5, 1, 0, 6]
    cu = torch.tensor([0] + lens).cumsum(0)
    g = torch.Generator().manual_seed(2)
    group = [
        (
            torch.randn(1, sum(lens), d, generator=g, dtype=torch.bfloat16),
            torch.randn(d, 1, W, generator=g),
            torch.randn(len(lens), d, W - 1, generator=g) if with_state else None,
        )
        for d in widths
    ]
    ups = [(torch.randn(1, sum(lens), d, generator=g), torch.randn(len(lens), d, W - 1, generator=g)) for d in widths]

    def run(call):
        leaves = [[t.clone().requires_grad_() if t is not None else None for t in member] for member in group]
        outs = call(leaves)
        sum((y.float() * uy).sum() + (s * us).sum() for (y, s), (uy, us) in zip(outs, ups)).backward()
        return [(y.detach(), s.detach()) for y, s in outs], [[t.grad for t in m if t is not None] for m in leaves]

    stacked, grads = run(
        lambda ls: causal_short_convs([m[0] for m in ls], [m[1] for m in ls], states=[m[2] for m in ls], cu_seqlens=cu)
    )
    single, grads1 = run(lambda ls: [causal_short_conv(x, w, state=st, cu_seqlens=cu) for x, w, st in ls])
    for (y, s), (y1, s1) in zip(stacked, single):
        assert y.dtype == y1.dtype and torch.equal(y, y1) and torch.equal(s, s1)
    for a, b in zip(grads, grads1):
        (gx, gw, *gs), (gx1, gw1, *gs1) = a, b
        assert torch.equal(gx, gx1) and all(torch.equal(u, v) for u, v in zip(gs, gs1))
        torch.testing.assert_close(gw, gw1, rtol=1e-6, atol=1e-6)  # a sum over tokens: its order may differ


def test_a_group_that_cannot_stack_runs_member_by_member():
    cu = torch.tensor([0, 3, 7])
    xs = [torch.randn(1, 7, 4), torch.randn(1, 7, 4)]
    ws = [torch.randn(4, 4), torch.randn(4, 2)]  # different tap counts
    got = causal_short_convs(xs, ws, states=[None, None], cu_seqlens=cu)
    for (y, s), x, w in zip(got, xs, ws):
        y1, s1 = causal_short_conv(x, w, cu_seqlens=cu)
        assert torch.equal(y, y1) and torch.equal(s, s1) and s.shape == (2, 4, w.shape[1] - 1)


def test_dtypes():
    x = torch.randn(2, 6, 4, dtype=torch.bfloat16)
    weight = torch.randn(4, 3, dtype=torch.bfloat16)
    y, s = causal_short_conv(x, weight)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
    torch.testing.assert_close(y, conv1d_reference(x, weight, None).bfloat16(), rtol=0, atol=0)
    _, s32 = causal_short_conv(x, weight, state=torch.zeros(2, 4, 2))
    assert s32.dtype == torch.float32


def test_errors():
    x, weight = torch.randn(2, 5, 4), torch.randn(4, 3)
    with pytest.raises(ValueError, match="`x`"):
        causal_short_conv(x[0], weight)
    with pytest.raises(ValueError, match="`weight`"):
        causal_short_conv(x, torch.randn(3, 3))
    with pytest.raises(ValueError, match="`weight`"):
        causal_short_conv(x, torch.randn(4, 2, 3))
    with pytest.raises(ValueError, match="`state`"):
        causal_short_conv(x, weight, state=torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_short_conv(x, weight, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_short_conv(x[:1], weight, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="`state`"):
        causal_short_conv(x[:1], weight, state=torch.randn(1, 4, 2), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="activation"):
        causal_short_conv(x, weight, activation="gelu")
