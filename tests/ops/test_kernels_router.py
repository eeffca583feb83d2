"""The router kernel (`miles_k3.kernels.router`) against its torch definition (`miles_k3.ops.router`), and
`route_tokens`' dispatch to it. The kernel runs on CPU through Triton's interpreter, in a subprocess
(`tests/rollout/interpreted.py`). Bounds (the kernel's docstring): the same expert set per token, weights
within a few fp32 ulps (relative 4e-7 here) of the definition's, the definition for grouped selection."""

import textwrap

from tests.rollout.interpreted import assert_interpreted_ok


def test_router_kernel_matches_the_definition_and_dispatches():
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        os.environ["MILES_K3_KERNELS"] = "interpret"
        import torch
        from miles_k3 import kernels as seam
        from miles_k3.kernels import router as kernels
        from miles_k3.ops.router import route_tokens

        g = torch.Generator().manual_seed(0)

        def by_expert(w, i):  # the definition's topk is unsorted: compare per expert
            order = i.sort(-1)
            return w.gather(1, order.indices), order.values

        cases = [(1, 64, 8, True, True, 1.0), (5, 48, 6, False, True, 2.5), (3, 17, 1, True, False, 1.0),
                 (4, 384, 8, True, True, 1.0), (2, 8, 8, True, True, 1.0), (0, 16, 2, True, True, 1.0),
                 (4, 16, 1, True, True, 2.446)]  # top-1 with renormalize: the raw score, scaled
        x = torch.tensor([[0.0, 2.0, -1.0, 1.0]])  # hand-computed: expert 3 (0.731 + 0.8), weight sigmoid(1) * 2.446
        w, i = kernels.route(x, torch.tensor([0.0, -0.5, 0.0, 0.8]), 1, True, 2.446)
        assert i.tolist() == [[3]] and abs(w.item() - 2.446 / (1 + 2.718281828459045**-1)) < 1e-6, (w, i)
        for n, e, k, bias, renormalize, scale in cases:
            x = torch.randn(n, e, generator=g) * 3
            b = torch.randn(e, generator=g) * 0.1 if bias else None
            got = kernels.route(x, b, k, renormalize, scale)
            want = route_tokens(x, b, k, renormalize=renormalize, scaling_factor=scale)
            assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64 and got[1].shape == (n, k)
            (gw, gi), (ww, wi) = by_expert(*got), by_expert(*want)
            assert torch.equal(gi, wi), (n, e, k, gi, wi)
            torch.testing.assert_close(gw, ww, rtol=4e-7, atol=0)
            if n:  # the chosen come in decreasing biased score
                choice = x.sigmoid() + (b if bias else 0)
                picked = choice.gather(1, got[1])
                assert (picked[:, :-1] >= picked[:, 1:]).all()
        # a bf16 bias is added in fp32, as the definition's cast does
        x, b = torch.randn(3, 32, generator=g), (torch.randn(32, generator=g) * 0.1).bfloat16()
        assert torch.equal(by_expert(*kernels.route(x, b, 4, True, 1.0))[1],
                           by_expert(*route_tokens(x, b, 4))[1])

        launches = []
        real = kernels.route
        kernels.route = lambda *a: launches.append(1) or real(*a)
        seam.reset()
        x = torch.randn(2, 32, generator=g)
        with torch.inference_mode():
            route_tokens(x, None, 4)
            assert launches == [1]
            route_tokens(x, None, 4, num_groups=4, topk_group=2)  # grouped: the definition
            route_tokens(x.double(), None, 4)  # fp64 logits: the definition
            assert launches == [1]
        route_tokens(x, None, 4)  # outside inference mode (the trainer): the definition
        assert launches == [1]
        print("ok")
    """),
        timeout=600,
    )
