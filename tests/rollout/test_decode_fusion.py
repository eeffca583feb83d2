"""The engine's decode-step fusions keep its outputs: fp32 storage of the parameters the definition upcasts,
and the log-prob gap of a bf16 engine against the fp32 reference."""

import copy

import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.layers import KDAMixer
from miles_k3.model.lora_spec import LoraSpec
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.forward import prepare_model, store_fp32_reads
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

    eng = Engine(model, EngineConfig(memory_bytes=8 << 20, page_size=4, chunk_size=8, max_prefill_tokens=16,
                                     max_seq_len=128))
    out = eng.generate([IDS[0].tolist()], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))[0]
    full = torch.tensor([IDS[0].tolist() + out.output_ids])
    ref_lp = logprobs(REF, full)[0, IDS.shape[1] - 1:-1].gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
    gap = float((torch.tensor(out.logprobs) - ref_lp).abs().max())
    assert gap < 3 * before + 1e-2, (gap, before)


def test_prepare_model_runs_once_and_leaves_an_fp32_model_alone():
    model = built()
    ref = copy.deepcopy(model)
    prepare_model(model)
    prepare_model(model)
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in ref.parameters()}
