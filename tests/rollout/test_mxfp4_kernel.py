"""The Triton MXFP4 grouped GEMM (rollout/kernels/mxfp4_moe.py) against decode-then-grouped-GEMM in torch.

Runs the kernel on CPU through Triton's interpreter, in a subprocess: TRITON_INTERPRET must be set before
the kernel is defined, and other tests import triton (through fla) first. fp32 only: the interpreter's
`tl.dot` on bf16 operands is wrong (triton 3.9 on CPU: errors of 1e10 on a plain 16x16 product), so the
bf16 path is checked compiled, on the GPU (tests/gpu/test_engine_cuda.py)."""

import textwrap

import torch

from rollout.kernels.mxfp4_moe import block_schedule
from tests.rollout.interpreted import assert_interpreted_ok

_CHECK = textwrap.dedent("""
    import torch
    from miles_k3.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from rollout.kernels.mxfp4_moe import mxfp4_grouped_matmul

    g = torch.Generator().manual_seed(0)
    cases = [  # (experts, N, K, rows per expert, block_m)
        (5, 72, 96, [3, 0, 20, 1, 9], 16),   # K = 3 x 32: BK 32; an expert with no rows
        (3, 64, 128, [40, 70, 0], 64),       # blocks of 64, a partial last block
        (4, 48, 64, [2, 5, 0, 1], None),     # decode-like: default block size
        (2, 16, 32, [0, 0], None),           # no rows at all
    ]
    for e, n, k, rows, bm in cases:
        w = torch.randn(e, n, k, generator=g) * torch.logspace(-3, 2, k)  # many block scales
        packed, scales = quantize_mxfp4(w)
        counts = torch.tensor(rows)
        x = torch.randn(int(counts.sum()), k, generator=g)
        got = mxfp4_grouped_matmul(x, counts, packed, scales, block_m=bm)
        want = torch._grouped_mm(x, dequantize_mxfp4(packed, scales, torch.float32).transpose(1, 2),
                                 offs=counts.cumsum(0).to(torch.int32))
        assert got.shape == want.shape, got.shape
        err = float((got - want).norm() / want.norm().clamp(min=1e-30)) if want.numel() else 0.0
        assert err < 1e-5, (e, n, k, rows, err)

    # the engine's grouped expert path with the kernel (one block schedule for w1, w3, w2) equals the torch path
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
""")


def test_kernel_equals_torch_decode_then_grouped_gemm():
    assert_interpreted_ok(_CHECK, timeout=300)


def test_block_schedule_covers_each_expert_in_order():
    counts = torch.tensor([3, 0, 20, 1, 9])
    block_expert, block_row, expert_end = block_schedule(counts, int(counts.sum()), 16)
    assert block_expert.numel() == -(-33 // 16) + 5  # the static bound: ceil(M / BM) + E
    valid = block_expert >= 0
    assert block_expert[valid].tolist() == [0, 2, 2, 3, 4] and not valid[valid.sum():].any()
    assert block_row[valid].tolist() == [0, 3, 19, 23, 24] and expert_end.tolist() == [3, 3, 23, 24, 33]


def test_engine_rejects_a_bad_mxfp4_matmul_and_triton_off_cuda():
    import pytest

    from miles_k3.model import K3Config, K3ForCausalLM
    from rollout.config import EngineConfig
    from rollout.engine import Engine

    with pytest.raises(ValueError, match="mxfp4_matmul must be one of"):
        EngineConfig(memory_bytes=1 << 20, mxfp4_matmul="cutlass")
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny"))
    with pytest.raises(ValueError, match="needs the model on CUDA"):
        Engine(model, EngineConfig(memory_bytes=4 << 20, mxfp4_matmul="triton"))
