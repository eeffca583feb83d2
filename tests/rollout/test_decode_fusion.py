"""The engine's decode-step fusions keep its outputs: shared-input GEMMs, fp32 storage of the parameters the
definition upcasts, and the log-prob gap of a bf16 engine against the fp32 reference."""

import copy

import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.layers import KDAMixer
from miles_k3.model.lora_spec import LoraSpec
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.forward import prepare_model, store_fp32_reads
from rollout.linears import EngineLinear, share_input_gemms
from rollout.model_runner import build_engine_model
from rollout.request import SamplingParams

torch.manual_seed(0)
REF = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
IDS = torch.randint(3, 512, (2, 11), generator=torch.Generator().manual_seed(0))


def built(dtype=torch.float32, quantize="none", lora=None):
    return build_engine_model(REF.config, REF.state_dict(), quantize=quantize, lora=lora, dtype=dtype)[0]


def logprobs(model, ids=IDS):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1)


@pytest.mark.parametrize("quantize", ["none", "all"])
def test_shared_input_gemms_keep_outputs_weights_and_state_dict(quantize):
    """One GEMM per group of same-input linears (KDA q/k/v/f_a/b/g, MLA q_a/kv_a/g, GLU gate/up, MoE latent
    down + shared gate/up) gives the separate GEMMs' logits; the members' weights become views of the
    group's one copy (no extra memory) and the state dict is unchanged."""
    model = built(quantize=quantize)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = logprobs(model)
    groups = share_input_gemms(model)
    c = REF.config
    moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    # a mixer and an MLP / MoE each, and each MoE's routed gate / up
    assert groups == c.num_hidden_layers + moe + (c.num_hidden_layers - moe) + moe
    assert share_input_gemms(model) == 0  # once
    mixer = next(m for m in model.modules() if isinstance(m, KDAMixer))
    name = "weight_packed" if quantize == "all" else "weight"
    q, k = (getattr(getattr(mixer, p), name) for p in ("q_proj", "k_proj"))
    assert mixer.q_proj.shared is mixer.k_proj.shared is not None
    assert k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], t) for n, t in before.items())
    torch.testing.assert_close(logprobs(model), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("quantize", ["none", "experts"])
def test_stacked_expert_gate_up_gives_the_separate_gemms_outputs(quantize):
    """After `share_gate_up` a batch's routed gate and up projections are one grouped GEMM over the stacked
    w13 (bf16 or MXFP4 bytes), split by columns, each with its own LoRA term: the separate GEMMs' outputs,
    with and without the batch's adapter; w1 / w3 become views of w13 and the state dict is unchanged."""
    from rollout.linears import EngineExperts

    model, pool = build_engine_model(
        REF.config,
        {k: v.bfloat16() for k, v in REF.state_dict().items()},
        quantize=quantize,
        lora=LoraSpec(rank=8),
        dtype=torch.bfloat16,
    )
    g = torch.Generator().manual_seed(2)
    adapter = {}
    for name in pool.A:  # a random adapter on every target
        adapter[f"{name}.lora_A"] = (torch.randn(pool.A[name].shape[1:], generator=g) * 0.2).bfloat16()
        adapter[f"{name}.lora_B"] = (torch.randn(pool.B[name].shape[1:], generator=g) * 0.2).bfloat16()
    pool.add_adapter("a", adapter)
    experts = next(m for m in model.modules() if isinstance(m, EngineExperts))
    e = experts.spec.num_experts
    counts = torch.tensor([3, 0, 5, 1] + [0] * (e - 4))
    xs = torch.randn(int(counts.sum()), experts.spec.width, generator=g).bfloat16()
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    wants = []
    for slot in (1, 0):
        pool.set_batch([slot] * 4, 1)
        wants.append(experts._experts_grouped(xs, counts))
    experts.share_gate_up()
    name = "w1_packed" if quantize == "experts" else "w1"
    assert (
        experts.gate_up
        and getattr(experts, name).untyped_storage().data_ptr()
        == getattr(experts, name.replace("w1", "w13")).untyped_storage().data_ptr()
    )
    after = model.state_dict()
    assert after.keys() == before_state.keys() and all(torch.equal(after[k], v) for k, v in before_state.items())
    for slot, want in zip((1, 0), wants):
        pool.set_batch([slot] * 4, 1)
        torch.testing.assert_close(experts._experts_grouped(xs, counts), want, rtol=0, atol=0)
    assert not torch.equal(wants[0], wants[1])  # the adapter's term is there to be kept


def test_a_shared_gemm_member_called_out_of_pattern_gets_its_own_output():
    """Members called alone, twice, or with different inputs in between each get x W^T of their own weight."""
    model = built()
    share_input_gemms(model)
    mixer = next(m for m in model.modules() if isinstance(m, KDAMixer))
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(3, REF.config.hidden_size, generator=g) for _ in range(2))
    calls = [
        (mixer.q_proj, x1),
        (mixer.v_proj, x2),
        (mixer.q_proj, x1),
        (mixer.q_proj, x1),
        (mixer.k_proj, x1),
        (mixer.b_proj, x2),
    ]
    for linear, x in calls:
        torch.testing.assert_close(linear(x), x @ linear.weight.t(), rtol=0, atol=1e-5)


def test_fp32_storage_of_upcast_parameters_is_bit_identical_in_bf16():
    """The conv, gated-norm and AttnRes parameters are read only upcast to fp32, so storing them in fp32
    (their bf16 values) changes no bit of a bf16 model's logits."""
    model = built(torch.bfloat16)
    want = logprobs(model)
    store_fp32_reads(model)
    mixer = next(m for m in model.modules() if isinstance(m, KDAMixer))
    assert mixer.q_conv1d.weight.dtype == mixer.o_norm.weight.dtype == torch.float32
    assert mixer.q_proj.weight.dtype == torch.bfloat16
    assert torch.equal(logprobs(model), want)


def test_prepared_bf16_engine_keeps_its_log_prob_gap_to_the_fp32_reference():
    """The accuracy gate for the fusions: a bf16 engine model's teacher-forced log-probs stay as close to the
    fp32 reference after `prepare_model` as before (MXFP4 experts and an adapter pool as in RL rollouts), and
    the engine's sampled log-probs match the reference's on its own tokens."""
    want = logprobs(REF)
    model = built(torch.bfloat16, quantize="experts", lora=LoraSpec(rank=8))
    before = float((logprobs(model) - want).abs().max())
    prepare_model(model)
    after = float((logprobs(model) - want).abs().max())
    assert after <= 1.1 * before + 1e-3, (before, after)

    eng = Engine(
        model, EngineConfig(memory_bytes=8 << 20, page_size=4, chunk_size=8, max_prefill_tokens=16, max_seq_len=128)
    )
    out = eng.generate([IDS[0].tolist()], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))[0]
    full = torch.tensor([IDS[0].tolist() + out.output_ids])
    ref_lp = logprobs(REF, full)[0, IDS.shape[1] - 1 : -1].gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    gap = float((torch.tensor(out.logprobs) - ref_lp).abs().max())
    assert gap < 3 * before + 1e-2, (gap, before)


def test_prepare_model_runs_once_and_leaves_an_fp32_model_alone():
    model = built()
    ref = copy.deepcopy(model)
    prepare_model(model)
    prepare_model(model)
    assert all(isinstance(m, EngineLinear) for m in model.modules() if hasattr(m, "shared"))
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in ref.parameters()}
