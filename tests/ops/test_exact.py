"""Exact mode's ops (`miles_k3.ops.exact`): a token's result is the same bits whatever shares its call.

The bit-for-bit checks run in a child process started with `exact.CPU_ENV` (the environment rollout.exact's
ranks start with: ATen's scalar and SIMD functions round alike, MKL takes one code path); each also shows
that the plain op is not invariant, so the check can fail."""

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from miles_k3.ops import exact
from miles_k3.ops.kda import kda
from miles_k3.ops.short_conv import causal_short_conv


def _child(check: str) -> None:
    """Run `check` (a function of this module) in a process started with exact.CPU_ENV."""
    code = f"import tests.ops.test_exact as t; t.{check}()"
    env = {**os.environ, **exact.CPU_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def check_products_are_row_invariant():
    assert exact.cpu_env_missing() == []
    g = torch.Generator().manual_seed(0)
    plain_varies = False
    for k, n in [(64, 64), (128, 16), (128, 1), (96, 4), (32, 300)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(70, k, generator=g)
        with exact.numerics():
            whole = F.linear(x, w)
            also = x @ w.t()
            for m, off in [(1, 0), (1, 33), (2, 5), (7, 1), (8, 8), (13, 40), (25, 0)]:
                part = x[off : off + m]
                assert torch.equal(F.linear(part, w), whole[off : off + m]), (k, n, m, off)
                assert torch.equal(part @ w.t(), also[off : off + m])
                batched = torch.matmul(part[None].expand(3, m, k), w.t())  # leading dims fold into rows
                assert torch.equal(batched[1], whole[off : off + m])
        plain_varies |= not torch.equal(F.linear(x[3:4], w), F.linear(x, w)[3:4])
    assert plain_varies  # one row through the BLAS rounds differently from a batch's row


def check_attention_is_the_same_for_packed_decode_and_batched_queries():
    g = torch.Generator().manual_seed(1)
    lens, h, d = [5, 23, 17], 3, 24
    q, k, v = (torch.randn(1, sum(lens), h, d, generator=g) for _ in range(3))
    bounds = torch.tensor([0, *lens]).cumsum(0).tolist()
    with exact.numerics():
        packed = exact.packed_attention(q, k, v, 0.3, bounds)
        for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
            for pos in range(eos - bos):  # a decode step: the query alone over its history
                one = exact.masked_attention(
                    q[:, bos + pos : bos + pos + 1], k[:, bos : bos + pos + 1], v[:, bos : bos + pos + 1], 0.3, None
                )
                assert torch.equal(one[0, 0], packed[0, bos + pos]), (s, pos)
        # a batch of two requests' last queries, histories right-padded to the longer one (masked)
        a, b = bounds[1], bounds[2]
        width = max(lens[1], lens[2])

        def padded(x, bos, n):
            return torch.cat([x[0, bos : bos + n], x.new_zeros(width - n, h, x.shape[-1])])

        keys = torch.stack([padded(k, a, lens[1]), padded(k, b, lens[2])])
        values = torch.stack([padded(v, a, lens[1]), padded(v, b, lens[2])])
        mask = torch.arange(width)[None, :] < torch.tensor([lens[1], lens[2]])[:, None]
        qs = torch.stack([q[0, b - 1 : b], q[0, bounds[3] - 1 : bounds[3]]])
        batch = exact.masked_attention(qs, keys, values, 0.3, mask[:, None, None, :])
        assert torch.equal(batch[0, 0], packed[0, b - 1]) and torch.equal(batch[1, 0], packed[0, bounds[3] - 1])
    reference = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(x[:, bos:eos].transpose(1, 2) for x in (q, k, v)), is_causal=True, scale=0.3
            ).transpose(1, 2)
            for bos, eos in zip(bounds[:-1], bounds[1:])
        ],
        dim=1,
    )
    torch.testing.assert_close(packed, reference, rtol=0, atol=2e-6)  # and it is attention


def check_kda_and_the_short_conv_step_as_their_packed_form():
    g = torch.Generator().manual_seed(2)
    t, h, dk = 11, 2, 16
    q, k, v = (torch.randn(1, t, h, dk, generator=g) for _ in range(3))
    gate, beta = -torch.rand(1, t, h, dk, generator=g), torch.rand(1, t, h, generator=g)
    x, w = torch.randn(1, t, 8, generator=g), torch.randn(8, 4, generator=g)
    with exact.numerics():
        whole, _ = kda(q, k, v, gate, beta, use_qk_l2norm=True)
        conv, _ = causal_short_conv(x, w)
        state, conv_state = torch.zeros(1, h, dk, dk), torch.zeros(1, 8, 3)
        for i in range(t):
            one, state = kda(
                *(y[:, i : i + 1] for y in (q, k, v, gate, beta)),
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm=True,
            )
            assert torch.equal(one[0, 0], whole[0, i]), i
            step, conv_state = causal_short_conv(x[:, i : i + 1], w, state=conv_state)
            assert torch.equal(step[0, 0], conv[0, i]), i


def test_products_are_row_invariant():
    _child("check_products_are_row_invariant")


def test_attention_is_the_same_for_packed_decode_and_batched_queries():
    _child("check_attention_is_the_same_for_packed_decode_and_batched_queries")


def test_kda_and_the_short_conv_step_as_their_packed_form():
    _child("check_kda_and_the_short_conv_step_as_their_packed_form")


def test_ops_without_a_fixed_order_are_refused_by_name():
    a = torch.randn(4, 4)
    with exact.numerics():
        with pytest.raises(RuntimeError, match=r"^exact mode \(rollout\.exact\): torch\.einsum sums in an order"):
            torch.einsum("ij,jk->ik", a, a)
        with pytest.raises(RuntimeError, match=r"scaled_dot_product_attention"):
            F.scaled_dot_product_attention(a[None, None], a[None, None], a[None, None])
        with exact.outside():  # what a drafter's attention runs in
            assert not exact.enabled()
            F.scaled_dot_product_attention(a[None, None], a[None, None], a[None, None])
        assert exact.enabled()
    assert not exact.enabled()
    torch.einsum("ij,jk->ik", a, a)  # the mode left with its block


def test_every_call_form_of_a_product_is_rerouted_or_refused():
    g = torch.Generator().manual_seed(3)
    x, w, v = torch.randn(3, 4, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, generator=g)
    with exact.numerics():
        assert torch.allclose(v @ v, (v * v).sum()) and (v @ v).dim() == 0
        assert torch.allclose(torch.matmul(x, other=w), x @ w) and torch.allclose(torch.linalg.matmul(x, w), x @ w)
        assert torch.mm(x, w).shape == (3, 6) and torch.bmm(x[None], w[None]).shape == (1, 3, 6)
        assert torch.allclose(F.linear(x, w.t(), bias=torch.ones(6)), x @ w + 1)
        with pytest.raises(RuntimeError, match="must be a matrix"):  # torch's own shape rules still hold
            torch.mm(x[None], w)
        for op in (lambda: torch.mv(x, v), lambda: torch.dot(v, v), lambda: torch.tensordot(x, w, 1)):
            with pytest.raises(RuntimeError, match=r"^exact mode \(rollout\.exact\)"):
                op()
        with pytest.raises(RuntimeError, match="out="):
            torch.matmul(x, w, out=torch.empty(3, 6))
        q, k = torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 3, 2, 8, generator=g)
        mask = torch.tensor([[True, True, False], [True, True, True]])  # [T, S]: broadcast over batch and heads
        assert exact.masked_attention(q, k, k, 0.3, mask).shape == (1, 2, 2, 8)
        with pytest.raises(RuntimeError, match="prefix"):
            exact.masked_attention(q, k, k, 0.3, torch.tensor([[False, True, True], [True, True, True]]))


def test_the_mode_holds_for_the_thread_that_entered_it():
    seen = {}
    with exact.numerics(), exact.numerics():  # nested: one mode
        other = threading.Thread(target=lambda: seen.setdefault("other", exact.enabled()))
        other.start()
        other.join()
        assert exact.enabled()
    assert seen == {"other": False} and not exact.enabled()
    with exact.numerics(False):
        assert not exact.enabled()


def test_the_cpu_environment_is_checked():
    missing = exact.cpu_env_missing()
    started_with = all(os.environ.get(k, "").lower() == v.lower() for k, v in exact.CPU_ENV.items())
    assert (missing == []) == started_with
