"""The SiTU-GLU Triton kernel (miles_k3/kernels/situ_glu.py) against the torch definition
(`miles_k3.ops.glu.situ_glu`), on CPU through Triton's interpreter in a subprocess; compiled on the GPU in
tests/gpu/test_decode_kernels.py."""

import textwrap

from tests.rollout.interpreted import assert_interpreted_ok

_CHECK = textwrap.dedent("""
    import torch
    from miles_k3.ops.glu import situ_glu as definition
    from miles_k3.kernels.situ_glu import situ_glu

    g = torch.Generator().manual_seed(0)
    for dtype, rel in [(torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -7)]:
        # rows strided inside a wider output (a shared GEMM's columns), a width over one block, a tiny and an
        # empty batch; up large and up small (tanh near 0, where 1 - 2 / (exp(2x) + 1) loses its digits)
        for (m, i), up_scale in [((3, 384), 8.0), ((5, 1500), 8.0), ((1, 7), 8.0), ((0, 16), 8.0),
                                 ((4, 384), 0.02)]:
            wide = (torch.randn(m, 2 * i + 3, generator=g) * 6).to(dtype)
            gate, up = wide[:, :i], (wide[:, i + 3:].float() * up_scale).to(dtype)
            got = situ_glu(gate, up, 4.0, 25.0)
            want = definition(gate, up, 4.0, 25.0)
            assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
            # fp32: to rounding; bf16: within one unit in the last place of the definition's result
            bound = want.float().abs() * rel + 1e-30
            assert bool(((got.float() - want.float()).abs() <= bound + 1e-5).all()), (dtype, m, i)
    # saturation: huge inputs give the capped values, not NaN
    x = torch.tensor([[-1e4, -50.0, 0.0, 50.0, 1e4]])
    torch.testing.assert_close(situ_glu(x, x, 4.0, 25.0), definition(x, x, 4.0, 25.0), rtol=1e-6, atol=1e-30)
    print("ok")
""")


def test_situ_glu_kernel_equals_the_definition():
    assert_interpreted_ok(_CHECK, timeout=300)
