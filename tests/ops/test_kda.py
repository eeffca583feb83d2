"""CPU tests for miles_k3.ops.kda against fla's pure-torch naive references."""

import math

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from miles_k3.ops.kda import kda, kda_chunked, kda_gate, kda_recurrent, l2norm

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_inputs(B=2, T=37, H=3, K=16, V=24, *, strong=False, with_state=True):
    """Realistic inputs: unit-norm keys (as the model feeds them) and gates from the K3 gate.

    ``strong`` pushes the lower-bound gate towards -5 per step so cumulative
    decays over a chunk reach hundreds in log space.
    """
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    f = torch.randn(B, T, H, K) + (6.0 if strong else 0.0)
    g = naive_kda_lowerbound_gate(f, torch.randn(H) * 0.5, None)
    beta = torch.rand(B, T, H)
    h0 = torch.randn(B, H, K, V) if with_state else None
    return q, k, v, g, beta, h0


# ----------------------------------------------------------------------------- gate


def test_gate_softplus_matches_fla_and_formula():
    H, K = 4, 8
    f = torch.randn(2, 5, H * K, dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    g = kda_gate(f, A_log, dt_bias, num_heads=H)
    assert g.dtype == torch.float32 and g.shape == (2, 5, H, K)
    torch.testing.assert_close(g, naive_kda_gate(f.unflatten(-1, (H, K)), A_log, dt_bias), **TOL)
    x = f.float().unflatten(-1, (H, K)) + dt_bias.view(H, K)
    by_hand = torch.stack([-math.exp(A_log[h]) * torch.log1p(torch.exp(x[..., h, :])) for h in range(H)], dim=-2)
    torch.testing.assert_close(g, by_hand, **TOL)


def test_gate_lower_bound_matches_fla_and_formula():
    H, K, lb = 4, 8, -3.0
    f = torch.randn(3, H * K) * 4
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    g = kda_gate(f, A_log, dt_bias, num_heads=H, form="lower_bound", lower_bound=lb)
    torch.testing.assert_close(g, naive_kda_lowerbound_gate(f.view(3, H, K), A_log, dt_bias, lower_bound=lb), **TOL)
    x = f.view(3, H, K) + dt_bias.view(H, K)
    by_hand = torch.stack([lb / (1 + torch.exp(-math.exp(A_log[h]) * x[:, h])) for h in range(H)], dim=1)
    torch.testing.assert_close(g, by_hand, **TOL)
    assert (g <= 0).all() and (g >= lb).all()


@pytest.mark.parametrize("form", ["softplus", "lower_bound"])
def test_gate_A_log_layouts(form):
    H, K = 96, 2
    f, dt_bias = torch.randn(4, H * K), torch.randn(H * K)
    A_log = torch.randn(H)
    ref = kda_gate(f, A_log, dt_bias, num_heads=H, form=form)
    padded = torch.cat([A_log, torch.zeros(128 - H)])
    for a in (padded, A_log.view(1, 1, H, 1)):
        torch.testing.assert_close(kda_gate(f, a, dt_bias, num_heads=H, form=form), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, A_log[:-1], dt_bias, num_heads=H, form=form)


def test_gate_errors():
    f = torch.randn(2, 12)
    with pytest.raises(ValueError, match="`f`"):
        kda_gate(f, torch.zeros(5), torch.zeros(12), num_heads=5)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, torch.zeros(3), torch.zeros(11), num_heads=3)
    with pytest.raises(ValueError, match="form"):
        kda_gate(f, torch.zeros(3), torch.zeros(12), num_heads=3, form="relu")


def test_l2norm():
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    y = l2norm(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.float() / x.float().norm(dim=-1, keepdim=True), **TOL)
    assert torch.isfinite(l2norm(torch.zeros(2, 4))).all()


# ----------------------------------------------------------------------------- recurrence


def test_recurrent_matches_naive():
    q, k, v, g, beta, h0 = make_inputs()
    o, ht = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, scale=0.3)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)
    o2, none = kda_recurrent(q, k, v, g, beta)
    assert none is None
    torch.testing.assert_close(o2, naive_recurrent_kda(q, k, v, g, beta)[0], **TOL)


@pytest.mark.parametrize("strong", [False, True])
def test_chunked_matches_naive_chunk(strong):
    q, k, v, g, beta, h0 = make_inputs(T=64, strong=strong)
    o, ht = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    o_ref, ht_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


@pytest.mark.parametrize("T,chunk_size", [(1, 16), (50, 16), (64, 64), (150, 64)])
@pytest.mark.parametrize("strong", [False, True])
def test_chunked_matches_recurrent(T, chunk_size, strong):
    q, k, v, g, beta, h0 = make_inputs(T=T, strong=strong)
    if strong:
        assert g.min() < -4.9 and g[:, :chunk_size].sum(1).min() < -4.5 * min(T, chunk_size)
    o, ht = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_chunked_extreme_constant_gate():
    """-5 per step for 64 steps: exp(+320) would overflow if ever formed."""
    q, k, v, _, beta, h0 = make_inputs(T=128, H=2)
    g = torch.full_like(q, -5.0)
    o, ht = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_chunked_gradients_match_recurrent():
    q, k, v, g, beta, h0 = make_inputs(B=1, T=24, H=2, K=8, V=8, strong=True)
    grads = []
    for fn in (kda_recurrent, lambda *a, **kw: kda_chunked(*a, chunk_size=8, **kw)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        (o.square().sum() + ht.sum()).backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_varlen_matches_per_sequence(mode):
    lens = [5, 0, 35, 2, 21]
    cu = torch.tensor([0] + lens).cumsum(0)
    N, T = len(lens), sum(lens)
    q, k, v, g, beta, _ = make_inputs(B=1, T=T, strong=True, with_state=False)
    h0 = torch.randn(N, q.shape[2], q.shape[3], v.shape[3])
    o, ht = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, mode=mode, chunk_size=16)
    assert o.shape == v.shape and ht.shape == h0.shape
    for i in range(N):
        s = slice(int(cu[i]), int(cu[i + 1]))
        o_i, h_i = naive_recurrent_kda(
            q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=h0[i : i + 1], output_final_state=True
        )
        torch.testing.assert_close(o[:, s], o_i, **TOL)
        torch.testing.assert_close(ht[i : i + 1], h_i, **TOL)
    # without initial states every segment starts from zeros
    o0, _ = kda(q, k, v, g, beta, cu_seqlens=cu, mode=mode, chunk_size=16)
    s = slice(int(cu[2]), int(cu[3]))
    torch.testing.assert_close(o0[:, s], naive_recurrent_kda(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s])[0], **TOL)


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunked])
def test_qk_l2norm_flag(fn):
    q, k, v, g, beta, h0 = make_inputs(T=70)
    k = torch.randn_like(k) * 3  # un-normalised: the flag must normalise it
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o_ref, ht_ref = naive_recurrent_kda(
        F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta, initial_state=h0, output_final_state=True
    )
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_dtypes_and_dispatch():
    q, k, v, g, beta, h0 = make_inputs(T=80)
    qb, kb, vb, bb = (x.bfloat16() for x in (q, k, v, beta))
    o, ht = kda(qb, kb, vb, g, bb, initial_state=h0.bfloat16(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    # CPU auto: chunked once T >= chunk_size, recurrent below
    assert torch.equal(kda(q, k, v, g, beta)[0], kda_chunked(q, k, v, g, beta)[0])
    short = [x[:, :10] for x in (q, k, v, g, beta)]
    assert torch.equal(kda(*short)[0], kda_recurrent(*short)[0])
    assert torch.equal(kda(*short, mode="chunked", chunk_size=4)[0], kda_chunked(*short, chunk_size=4)[0])
    with pytest.raises(ValueError, match="mode"):
        kda(q, k, v, g, beta, mode="fast")


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunked, kda])
def test_input_errors(fn):
    q, k, v, g, beta, h0 = make_inputs(T=6)
    bad = {
        "`q`": (q[0], k, v, g, beta),
        "`k`": (q, k[..., :-1], v, g, beta),
        "`v`": (q, k, v[:, :-1], g, beta),
        "`g`": (q, k, v, g[:, :, :-1], beta),
        "`beta`": (q, k, v, g, beta[..., None]),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError, match=name):
            fn(*args)
    with pytest.raises(ValueError, match="initial_state"):
        fn(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6]))
    one = [x[:1] for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="cu_seqlens"):
        fn(*one, cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="initial_state"):
        fn(*one, cu_seqlens=torch.tensor([0, 3, 6]), initial_state=h0[:1])


def test_gate_reads_the_heads_of_a_padded_a_log_and_ignores_the_padding():
    torch.manual_seed(0)
    H, K = 3, 8
    f = torch.randn(2, 5, H * K)
    A_log = torch.randn(H) * 0.5
    dt = torch.randn(H * K)
    x = (f + dt).view(2, 5, H, K)
    rate = A_log.exp().view(H, 1)
    padded = torch.cat([A_log, torch.randn(5)])
    got = kda_gate(f, padded, dt, num_heads=H, form="lower_bound", lower_bound=-5.0)
    torch.testing.assert_close(got, -5.0 * torch.sigmoid(rate * x))
    got = kda_gate(f, A_log.view(1, 1, H, 1), dt, num_heads=H, form="softplus")
    torch.testing.assert_close(got, -rate * torch.nn.functional.softplus(x))
    with pytest.raises(ValueError, match="num_heads"):
        kda_gate(f, A_log[:2], dt, num_heads=H)
