"""The MoE dispatch and combine kernels (`miles_k3.kernels.moe_dispatch`) against the definition
(`RoutedExperts.forward`'s sort, counts and index_add), on CPU through Triton's interpreter in a subprocess
(`tests/rollout/interpreted.py`). Bounds (the kernels' docstring): the sorted order, each copy's token and
the counts exactly the definition's; the combine within its own rounding of an fp64 sum of the rounded
weighted rows; `RoutedExperts` through the kernels equal to its definition by the same bound."""

import textwrap

from tests.rollout.interpreted import assert_interpreted_ok


def test_dispatch_and_combine_match_the_definition_and_dispatch():
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        os.environ["MILES_K3_KERNELS"] = "interpret"
        import torch
        from miles_k3 import kernels as seam
        from miles_k3.kernels import moe_dispatch as kernels
        from miles_k3.model.linear import ExpertsSpec
        from miles_k3.model.moe import RoutedExperts

        g = torch.Generator().manual_seed(0)

        # align: ties everywhere (few experts, many pairs), a power-of-two expert count, K3's 896, one pair;
        # up to 256 pairs one program sorts, more are placed by blocks (a partial last block, ties across blocks)
        for n, k, e in [(7, 4, 3), (64, 4, 64), (256, 16, 896), (1, 1, 1), (5, 8, 16), (300, 4, 3),
                        (1000, 16, 64)]:
            idx = torch.randint(0, e, (n, k), generator=g)
            token_of, counts, pos = kernels.align(idx, e)
            order = idx.reshape(-1).argsort(stable=True)
            assert torch.equal(token_of, order // k), (n, k, e)
            assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=e)), (n, k, e)
            assert torch.equal(pos[order], torch.arange(n * k)), (n, k, e)

        def bound_ok(got, ys, w, pos, dtype):
            # the kernel's sum of the rounded rows, against fp64: its fp32 adds plus its final rounding
            terms = (ys[pos].view(*w.shape, -1).float() * w[..., None]).to(dtype).double()
            exact = terms.sum(1)
            ulp = torch.finfo(dtype).eps
            slack = exact.abs() * ulp + terms.abs().sum(1) * 2.0 ** -23 + 1e-30
            return bool(((got.double() - exact).abs() <= slack).all())

        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n, k, d in [(3, 4, 96), (1, 16, 1500), (9, 2, 7)]:
                idx = torch.randint(0, 8, (n, k), generator=g)
                w = torch.rand(n, k, generator=g)
                token_of, counts, pos = kernels.align(idx, 8)
                ys = (torch.randn(n * k, d + 5, generator=g) * 4).to(dtype)[:, :d]  # a row stride of its own
                got = kernels.combine(ys, w, pos, dtype)
                assert got.dtype == dtype and got.shape == (n, d)
                assert bound_ok(got, ys, w, pos, dtype), (dtype, n, k, d)

        # RoutedExperts through the kernels (inference mode) against its definition (MILES_K3_KERNELS=0)
        spec = ExpertsSpec("experts", 8, 32, 48, "silu", 1.0, 1.0)
        experts = RoutedExperts(spec)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.2, generator=g)
        x, idx = torch.randn(6, 32, generator=g), torch.randint(0, 8, (6, 3), generator=g)
        w = torch.rand(6, 3, generator=g)
        calls = []
        real = kernels.combine
        kernels.combine = lambda *a: calls.append(1) or real(*a)
        with torch.inference_mode():
            got = experts(x, idx, w)
            os.environ["MILES_K3_KERNELS"] = "0"
            seam.reset()
            want = experts(x, idx, w)
        assert calls == [1]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        print("ok")
    """),
        timeout=600,
    )
