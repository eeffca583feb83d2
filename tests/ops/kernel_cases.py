"""The op calls each kernel behind `miles_k3.kernels.use_kernels` stands in for, at k3-small's widths: the
GPU test runs them on CUDA against their definitions (tests/gpu/test_decode_kernels.py), the CPU compile
check records their launches through the interpreter (tests/ops/test_kernels_compile.py)."""

from collections.abc import Callable

import torch

from miles_k3.ops.attnres import add_attn_res_mix_rms_norm, attn_res_mix
from miles_k3.ops.glu import situ_glu
from miles_k3.ops.kda import kda_gate_beta
from miles_k3.ops.norm import gated_rms_norm, rms_norm
from miles_k3.ops.router import route_tokens, router_logits
from miles_k3.ops.short_conv import causal_short_conv, causal_short_convs


def op_calls(device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, Callable[[], object]]:
    """{kernel name: a call of its op} on `device` in `dtype` (a width of 7168, 4 KDA heads of 96, a
    4-tap conv with its state, K3's 896 experts top-16). Inputs are drawn here, once: each call computes on
    the same tensors however often it runs."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=device, generator=g) * scale

    x, gate = rand(3, 7168).to(dtype), rand(3, 7168).to(dtype)
    w, blocks = rand(7168).to(dtype), [rand(3, 7168).to(dtype) for _ in range(5)]
    hk = rand(4, 96 * 4, scale=2.0).to(dtype)
    conv_w, state = rand(96 * 4, 1, 4, scale=0.5), rand(4, 96 * 4, 3).to(dtype)
    block, row = rand(4, 5, 96 * 4).to(dtype), rand(2, 21, 96 * 4).to(dtype)  # a verify step's; a prefill's
    f, b, a_log, dt = rand(4, 1, 96 * 4).to(dtype), rand(4, 1, 4).to(dtype), rand(4), rand(96 * 4)
    qkv, planes = rand(4, 1, 3 * 96 * 4 + 8).to(dtype), rand(4, 3, 96 * 4, 3).to(dtype)  # one GEMM's q | k | v
    group = ([qkv[..., i * 384 : (i + 1) * 384] for i in range(3)], [conv_w] * 3, [planes[:, i] for i in range(3)])
    logits, bias = rand(64, 896), rand(896, scale=0.1)  # the router's GEMM output is fp32
    router = rand(896, 7168, scale=0.01)  # an fp32 router weight (its logits O(1): the bounds' scale)
    return {
        "rms_norm": lambda: rms_norm(x, w, 1e-5),
        "gated_rms_norm": lambda: gated_rms_norm(x.view(3, 56, 128), gate.view(3, 56, 128), w[:128], 1e-5),
        "attn_res_mix": lambda: attn_res_mix(x, blocks, w, w[None], 1e-5),
        "add_attn_res_mix": lambda: torch.cat(add_attn_res_mix_rms_norm(x, gate, blocks, w, w[None], 1e-5, w, 1e-5)),
        "situ_glu": lambda: situ_glu(x, gate),
        "short_conv": lambda: causal_short_conv(hk[:, None], conv_w, state=state)[0],
        "short_conv_block": lambda: causal_short_conv(block, conv_w, state=state)[0],
        "short_conv_no_state": lambda: causal_short_conv(row, conv_w)[0],
        "short_convs": lambda: torch.cat([y for y, _ in causal_short_convs(*group[:2], states=group[2])], -1),
        "kda_gate": lambda: kda_gate_beta(f, b, a_log, dt, num_heads=4, form="lower_bound")[0],
        "router_logits": lambda: router_logits(x[:2], router),  # a decode step's few rows
        "route": lambda: route_tokens(logits, bias, 16),
    }
