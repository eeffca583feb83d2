"""The same parity checks on CUDA in bf16, through fla's Triton kernels (run on the device machine).

Tolerances (bf16 inputs, fp32 references, relative Frobenius error): KDA outputs and final states
<= 2e-2 against our fp32 torch reference. Whole models amplify bf16 rounding, so model logits are held
to the measured bf16 floor: <= 1.25x the error of a bf16 run of the reference itself on CPU.
"""

import pytest
import torch

from miles_k3.model import DenseStateCache, K3Config, K3ForCausalLM
from miles_k3.ops.kda import kda, kda_gate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kda_inputs(b, t, h, d, seed=0, form="lower_bound"):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, device=DEV, generator=g).bfloat16() for _ in range(3))
    f = torch.randn(b, t, h * d, device=DEV, generator=g)
    gate = kda_gate(
        f,
        torch.rand(h, device=DEV, generator=g).log1p(),
        torch.randn(h * d, device=DEV, generator=g),
        num_heads=h,
        form=form,
    )
    beta = torch.rand(b, t, h, device=DEV, generator=g)
    return q, k, v, gate, beta


@pytest.mark.parametrize("form", ["lower_bound", "softplus"])
def test_fla_chunk_kda_matches_reference(form):
    q, k, v, g, beta = kda_inputs(2, 1000, 4, 64, form=form)
    s0 = torch.randn(2, 4, 64, 64, device=DEV) * 0.1
    o, st = kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True)
    o_ref, st_ref = kda(
        q.float(),
        k.float(),
        v.float(),
        g,
        beta,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm=True,
        mode="chunked",
    )
    assert o.dtype == torch.bfloat16 and st.dtype == torch.float32
    assert rel(o, o_ref) <= 2e-2 and rel(st, st_ref) <= 2e-2


def test_fla_varlen_and_decode_match_reference():
    q, k, v, g, beta = kda_inputs(1, 700, 4, 64, seed=1)
    cu = torch.tensor([0, 100, 101, 450, 700], device=DEV)
    o, st = kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True)
    o_ref, st_ref = kda(
        q.float(),
        k.float(),
        v.float(),
        g,
        beta,
        cu_seqlens=cu,
        output_final_state=True,
        use_qk_l2norm=True,
        mode="chunked",
    )
    assert rel(o, o_ref) <= 2e-2 and rel(st, st_ref) <= 2e-2
    # single-token decode through fused_recurrent_kda from a carried state
    with torch.no_grad():
        o1, st1 = kda(
            q[:, :1],
            k[:, :1],
            v[:, :1],
            g[:, :1],
            beta[:, :1],
            initial_state=st[-1:],
            output_final_state=True,
            use_qk_l2norm=True,
        )
    o1_ref, st1_ref = kda(
        q[:, :1].float(),
        k[:, :1].float(),
        v[:, :1].float(),
        g[:, :1],
        beta[:, :1],
        initial_state=st[-1:],
        output_final_state=True,
        use_qk_l2norm=True,
        mode="recurrent",
    )
    assert rel(o1, o1_ref) <= 2e-2 and rel(st1, st1_ref) <= 2e-2


def small_k3():
    # k3-tiny's structure at fla-friendly head sizes; every KDA test here uses H=4, K=64 so fla autotunes once
    return K3Config.from_preset("k3-tiny", hidden_size=256, kda_head_dim=64, kda_num_heads=4)


def test_model_bf16_cuda_matches_fp32_reference():
    """bf16 on CUDA (fla kernels, grouped-GEMM experts) is as close to fp32 as bf16 on CPU (torch reference)
    is: random networks amplify bf16 rounding (and flip some routing), so the floor is measured, not assumed.
    Measured 2026-11-30 on an H200: CUDA 0.040, CPU bf16 floor 0.036."""
    torch.manual_seed(0)
    ref = K3ForCausalLM(small_k3()).eval()
    ids = torch.randint(0, ref.config.vocab_size, (2, 300))
    with torch.no_grad():
        want = ref(ids).logits
        floor = rel(ref.to(torch.bfloat16)(ids).logits, want)
        got = ref.to(DEV)(ids.to(DEV)).logits.cpu()
    assert rel(got, want) <= min(5e-2, 1.25 * floor)


def test_decode_on_cuda_matches_full_forward():
    torch.manual_seed(1)
    model = K3ForCausalLM(small_k3()).to(DEV, torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 80), device=DEV)
    with torch.no_grad():
        full = model(ids).logits
        cache = DenseStateCache(model.config)
        steps = [model(ids[:, :64], cache).logits] + [model(ids[:, t : t + 1], cache).logits for t in range(64, 80)]
    assert rel(torch.cat(steps, 1), full) <= 3e-2


def test_kimi_linear_parity_on_cuda(tmp_path):
    """Ours on CUDA in bf16 (fla kernels) against transformers' KimiLinear in fp32 on CPU (its torch path), no
    worse than transformers' own bf16 run against its fp32 run. Measured 2026-11-30 on an H200: ours 0.284,
    transformers bf16 0.330 (this oracle's weights have std 1/sqrt(fan_in), which bf16 handles poorly)."""
    from tests.model.kimi_linear_oracle import random_kimi_linear

    oracle = random_kimi_linear(
        tmp_path, hidden=128, layers=5, heads=4, head_dim=32, kda_heads=4, kda_head_dim=64, experts=8, top_k=2, seed=7
    )
    ours = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device=DEV).eval()
    ids = torch.randint(0, 64, (2, 200))
    with torch.no_grad():
        want = oracle(ids).logits
        got = ours(ids.to(DEV)).logits.cpu()
        floor = rel(oracle.bfloat16()(ids).logits, want)
    assert rel(got, want) <= 1.25 * floor
