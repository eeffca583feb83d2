"""The Triton grouped GEMMs over routed experts (rollout/kernels/expert_gemm.py): bf16 weights against an fp64
product, MXFP4 weights against decode-then-grouped-GEMM in torch, and the engine's dispatch to them.

The kernels run on CPU through Triton's interpreter, in a subprocess: TRITON_INTERPRET must be set before a
kernel is defined, and other tests import triton (through fla) first. fp32 only: the interpreter's `tl.dot`
on bf16 operands is wrong (triton 3.9 on CPU: errors of 1e10 on a plain 16x16 product), so the bf16 runs
are checked compiled, on the GPU (tests/gpu/test_engine_cuda.py); the bf16 dispatch is checked here with the
kernel's result stood in by torch's."""

import textwrap

from tests.rollout.interpreted import assert_interpreted_ok, run_and_compile

_CASES = """
    cases = [  # (experts, N, K, rows per expert, block_m)
        (5, 72, 96, [3, 0, 20, 1, 9], 16),   # an expert with no rows; experts over one block of 16
        (3, 64, 128, [40, 70, 0], 64),       # blocks of 64, a partial last block
        (4, 48, 64, [2, 5, 0, 1], None),     # decode-like: default block size
        (2, 16, 32, [0, 0], None),           # no rows at all
        (1, 8, 32, [33], 16),                # one expert, three blocks
    ]
"""

_CHECK = textwrap.dedent(
    """
    import torch
    from miles_k3.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from rollout.kernels.expert_gemm import grouped_matmul, mxfp4_grouped_matmul

    g = torch.Generator().manual_seed(0)

    def per_expert(x, w, counts):  # the fp64 reference: each expert's rows times its weight
        parts = [xe @ we.T for xe, we in zip(x.split(counts.tolist()), w)]
        return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])
"""
    + _CASES
    + """
    for e, n, k, rows, bm in cases:
        counts = torch.tensor(rows)
        m = int(counts.sum())
        wide = torch.randn(m, k + 8, generator=g)
        x = wide[:, 5:5 + k]  # rows with a stride of their own
        offs = counts.cumsum(0).to(torch.int32)

        w = torch.randn(e, n, k, generator=g)
        got = grouped_matmul(x, counts, w, block_m=bm)
        exact = per_expert(x.double(), w.double(), counts)
        slack = k * 2.0 ** -23 * per_expert(x.double().abs(), w.double().abs(), counts)
        assert got.shape == (m, n) and bool(((got.double() - exact).abs() <= slack + 1e-30).all()), (e, n, k, rows)

        wq = torch.randn(e, n, k, generator=g) * torch.logspace(-3, 2, k)  # many block scales
        packed, scales = quantize_mxfp4(wq)
        got = mxfp4_grouped_matmul(x, counts, packed, scales, block_m=bm)
        want = torch._grouped_mm(x.contiguous(), dequantize_mxfp4(packed, scales, torch.float32).transpose(1, 2),
                                 offs=offs)
        assert got.shape == want.shape, got.shape
        err = float((got - want).norm() / want.norm().clamp(min=1e-30)) if want.numel() else 0.0
        assert err < 1e-5, (e, n, k, rows, err)

    # K not a multiple of the bf16 kernel's block: the tail is masked
    x, w, counts = torch.randn(7, 72, generator=g), torch.randn(2, 24, 72, generator=g), torch.tensor([4, 3])
    want = torch._grouped_mm(x, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    torch.testing.assert_close(grouped_matmul(x, counts, w), want, rtol=1e-5, atol=1e-5)

    # the engine's grouped expert path with the MXFP4 kernel equals the torch path
    from miles_k3.model import K3Config, K3ForCausalLM
    from rollout.linears import EngineExperts
    from miles_k3.model.lora_spec import LoraSpec
    from rollout.model_runner import build_engine_model

    torch.manual_seed(0)
    ref = K3ForCausalLM(K3Config.from_preset("k3-tiny"))
    model, pool = build_engine_model(ref.config, ref.state_dict(), quantize="experts", lora=LoraSpec(rank=8),
                                     dtype=torch.float32)
    experts = next(m for m in model.modules() if isinstance(m, EngineExperts))
    pool.set_batch([0] * 4, 1)
    counts = torch.tensor([3, 0, 5, 1] + [0] * (experts.spec.num_experts - 4))
    xs = torch.randn(int(counts.sum()), experts.spec.width, generator=g)
    want = experts._experts_grouped(xs, counts)
    experts.mxfp4_matmul = "triton"
    got = experts._experts_grouped(xs, counts)
    assert float((got - want).norm() / want.norm()) < 1e-5
    print("ok")
"""
)


def test_grouped_gemms_match_an_fp64_product_and_the_decoded_mxfp4_weights():
    assert_interpreted_ok(_CHECK, timeout=300)


def test_bf16_experts_dispatch_to_the_kernel_at_decode_sizes_only():
    """Under inference mode with kernels on, a bf16 engine's expert GEMMs go to `grouped_matmul` when the rows
    are at most MAX_ROWS_PER_EXPERT an expert (gate and up as one call over w13, then w2); more rows, fp32,
    or no inference mode keep torch's grouped GEMM. The kernel's bf16 result is torch's here (module doc)."""
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        os.environ["MILES_K3_KERNELS"] = "interpret"
        import torch
        from miles_k3 import kernels as seam
        from miles_k3.model import K3Config, K3ForCausalLM
        from rollout.kernels import expert_gemm
        from rollout.linears import EngineExperts, share_input_gemms
        from rollout.model_runner import build_engine_model

        seam.reset()
        calls = []
        def stand_in(x, counts, w):
            calls.append(tuple(w.shape))
            return torch._grouped_mm(x, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
        expert_gemm.grouped_matmul = stand_in

        torch.manual_seed(0)
        ref = K3ForCausalLM(K3Config.from_preset("k3-tiny"))
        for dtype in (torch.bfloat16, torch.float32):
            model, _ = build_engine_model(ref.config, ref.state_dict(), quantize="none", dtype=dtype)
            share_input_gemms(model)
            experts = next(m for m in model.modules() if isinstance(m, EngineExperts))
            e, i, width = experts.spec.num_experts, experts.spec.intermediate, experts.spec.width
            for per_expert in (1, expert_gemm.MAX_ROWS_PER_EXPERT, expert_gemm.MAX_ROWS_PER_EXPERT + 1):
                counts = torch.full((e,), per_expert)
                xs = torch.randn(int(counts.sum()), width).to(dtype)
                calls.clear()
                with torch.inference_mode():
                    got = experts._experts_grouped(xs, counts)
                taken = dtype == torch.bfloat16 and per_expert <= expert_gemm.MAX_ROWS_PER_EXPERT
                assert calls == ([(e, 2 * i, width), (e, width, i)] if taken else []), (dtype, per_expert, calls)
                calls.clear()
                torch.testing.assert_close(experts._experts_grouped(xs, counts), got)  # no inference mode
                assert calls == []
        print("ok")
    """),
        timeout=300,
    )


def test_both_kernels_compile_for_sm90_in_bf16_at_every_benchmarked_tile(tmp_path):
    """What the interpreter does not check (its bf16 dot is not the device's): the launches the engine makes,
    bf16 rows and weights at k3-small's expert shapes, and every tile of the benchmark's sweep, compile."""
    names = run_and_compile(
        textwrap.dedent("""
        import json, os, sys
        import torch
        from miles_k3.kernels import interpreted_launches
        from rollout.kernels.expert_gemm import grouped_matmul, mxfp4_grouped_matmul
        sys.path.insert(0, "scripts")
        from bench_decode_kernels import EXPERT_TILES

        e, n, k = 64, 768, 512
        counts = torch.full((e,), 4)
        x = torch.zeros(4 * e, k, dtype=torch.bfloat16)
        w = torch.zeros(e, n, k, dtype=torch.bfloat16)
        packed = torch.zeros(e, n, k // 2, dtype=torch.uint8)
        scales = torch.full((e, n, k // 32), 127, dtype=torch.uint8)
        record = []
        with interpreted_launches(record):
            for bn, bk, warps, stages in EXPERT_TILES:
                grouped_matmul(x[:8], counts[:2] * 1, w[:2, :bn], block_n=bn, block_k=bk, num_warps=warps,
                               num_stages=stages)
            mxfp4_grouped_matmul(x[:8], counts[:2], packed[:2, :64], scales[:2, :64])
        with open(os.environ["LAUNCHES_JSON"], "w") as f:
            json.dump(record, f)
        print("ok")
    """),
        tmp_path,
    )
    assert names == ["_grouped_gemm"] * 6 + ["_mxfp4_grouped_gemm"]
