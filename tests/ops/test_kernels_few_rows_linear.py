"""The few-rows linear kernel (`miles_k3.kernels.few_rows_linear`) against an fp64 product, and its two callers'
dispatch: the router's fp32 logits (`miles_k3.ops.router.router_logits`) and the engine's base GEMMs
(`rollout.linears.base_gemm`). The kernel runs on CPU through Triton's interpreter, in a subprocess
(`tests/rollout/interpreted.py`). Bound (the kernel's docstring): before the final rounding, within
K * 2^-24 * sum_k |x_k w_k| of the exact sum; after it, one unit in the last place of the output dtype more."""

import textwrap

from tests.rollout.interpreted import assert_interpreted_ok


def test_few_rows_linear_matches_an_fp64_product_and_its_callers_dispatch_to_it():
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        os.environ["MILES_K3_KERNELS"] = "interpret"
        import torch
        import torch.nn.functional as F
        from miles_k3 import kernels as seam
        from miles_k3.kernels import few_rows_linear as kernels
        from miles_k3.ops.router import router_logits
        from rollout.linears import base_gemm

        g = torch.Generator().manual_seed(0)
        # rows 1-4 (one program's rows padded to a power of two), K over one chunk and not a power of two, N not
        # a multiple of the block, rows of a wider weight (a shared GEMM's members), x a column slice
        cases = [(1, 1024, 96), (2, 700, 33), (3, 64, 130), (4, 1536, 17), (1, 5, 3)]
        for dtype, out_dtype in [(torch.bfloat16, None), (torch.float32, None), (torch.float16, None),
                                 (torch.bfloat16, torch.float32)]:
            for m, k, n in cases:
                wide = torch.randn(m, k + 8, generator=g).to(dtype)
                x = wide[:, 3:3 + k]
                big = torch.randn(n + 5, k, generator=g).to(dtype)
                w = big[2:2 + n]
                assert kernels.supports(x, w, out_dtype)
                got = kernels.linear(x, w, out_dtype)
                exact = x.double() @ w.double().T
                want = exact.to(out_dtype or dtype)
                assert got.dtype == want.dtype and got.shape == (m, n) and got.is_contiguous()
                slack = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
                ulp = torch.finfo(got.dtype).eps * exact.abs()
                assert bool(((got.double() - exact).abs() <= slack + ulp + 1e-30).all()), (dtype, out_dtype, m, k, n)
        # leading dims [B, T]; more rows than MAX_ROWS, a non-collapsing view, fp64 or a mismatched K: not taken
        x = torch.randn(2, 2, 64, generator=g)
        w = torch.randn(40, 64, generator=g)
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-6, atol=1e-6)
        assert not kernels.supports(torch.randn(kernels.MAX_ROWS + 1, 64), w)
        big = torch.empty(kernels.MAX_WORK // 128 + 1, 64)  # 2 rows of it: past MAX_WORK, cuBLAS's to run
        assert kernels.fits(torch.randn(2, 64), big) and not kernels.supports(torch.randn(2, 64), big)
        assert not kernels.supports(torch.randn(3, 4, 64)[:, :2], w)
        assert not kernels.supports(x.double(), w.double())
        assert not kernels.supports(torch.randn(1, 63), w)

        launches = []
        real = kernels.linear
        kernels.linear = lambda *a: launches.append(a[2] if len(a) > 2 else None) or real(*a)
        seam.reset()
        xb, wr = torch.randn(1, 64, generator=g).bfloat16(), torch.randn(16, 64, generator=g)
        with torch.inference_mode():
            logits = router_logits(xb, wr)  # bf16 activations, fp32 router weight: fp32 logits, no upcast copy
            assert logits.dtype == torch.float32 and launches == [torch.float32]
            torch.testing.assert_close(logits, F.linear(xb.float(), wr), rtol=1e-6, atol=1e-6)
            base_gemm(xb, wr.bfloat16())
            assert launches == [torch.float32, None]
            base_gemm(torch.randn(8, 64).bfloat16(), wr.bfloat16())  # a batch of 8: cuBLAS's
            router_logits(xb.double(), wr.double())  # fp64: the definition (fp32 logits)
            assert len(launches) == 2
        assert router_logits(xb, wr).dtype == torch.float32 and len(launches) == 2  # no inference mode: definition
        print("ok")
    """),
        timeout=600,
    )
