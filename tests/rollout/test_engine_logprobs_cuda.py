"""Top log-probs on the engine's CUDA path (run on the device machine): the kernel sampler for rows that do not
ask, the torch path for rows that do, decode replayed from CUDA graphs with the overlap schedule; each reported
log-prob is its own top entry (one log-softmax), and fp32 values equal the model's distribution."""

import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.cache import DenseStateCache
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = dict(memory_bytes=64 << 20, page_size=16, chunk_size=32, max_seq_len=512, max_running=8)


def model(dtype):
    torch.manual_seed(3)
    config = K3Config.from_preset("k3-tiny", hidden_size=256, kda_head_dim=64, kda_num_heads=4)
    return K3ForCausalLM(config).to("cuda", dtype).eval()


def prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def params(i: int) -> SamplingParams:
    if i % 2:  # every other request asks nothing: the kernel samples it
        return SamplingParams(temperature=0.8, max_new_tokens=40, seed=i)
    return SamplingParams(
        temperature=0.8 if i % 4 else 0.0,
        max_new_tokens=40,
        seed=i,
        top_logprobs=5,
        token_ids_logprob=(7, 9),
        logprob_start_len=3,
    )


def check_consistent(outs, ps):
    for c, p in zip(outs, ps):
        if not p.alternatives:
            assert c.top_logprobs is None
            continue
        assert len(c.top_logprobs) == len(c.output_ids) == len(c.token_ids_logprobs)
        for tok, lp, top in zip(c.output_ids, c.logprobs, c.top_logprobs):
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and values[0] >= lp - 1e-6
            if tok in dict(top):
                assert dict(top)[tok] == lp  # one log-softmax for both


def test_graphs_and_overlap_report_the_sampled_tokens_own_distribution():
    m = model(torch.bfloat16)
    ps = [params(i) for i in range(6)]
    eng = Engine(m, EngineConfig(max_prefill_tokens=64, **CFG))
    outs = eng.generate(prompts([5, 20, 30, 40, 50, 60], 0), ps)
    assert eng.overlap and eng.graphs is not None and eng.graphs.replays > 0
    check_consistent(outs, ps)
    eng.check_invariants()


def test_fp32_values_equal_the_models_distribution():
    m = model(torch.float32)
    ps = [params(i) for i in range(4)]
    eng = Engine(m, EngineConfig(max_prefill_tokens=64, **CFG))
    outs = eng.generate(prompts([9, 33, 17, 40], 1), ps)
    check_consistent(outs, ps)
    for c, p in zip(outs, ps):
        if not p.alternatives:
            continue
        with torch.inference_mode():
            ids = torch.tensor([c.prompt_ids + c.output_ids], device="cuda")
            logits = m(ids, DenseStateCache(m.config)).logits[0].float()
        ref = torch.log_softmax(logits / (p.temperature or 1.0), dim=-1).cpu()
        n = len(c.prompt_ids)
        for i, top in enumerate(c.top_logprobs):
            want = ref[n + i - 1].topk(5)
            assert torch.allclose(torch.tensor([v for _, v in top]), want.values, atol=1e-3)
        for j, lp in enumerate(c.prompt.logprobs):
            q = c.prompt.start + j
            assert lp == pytest.approx(ref[q - 1, c.prompt_ids[q]].item(), abs=1e-3)
