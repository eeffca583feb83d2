"""Engine step shapes: packed multi-request prefill and padded (CUDA-graph-shaped) decode equal the
one-request-at-a-time engine and the reference model; the batched sampler's contract."""

import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.generate import greedy_generate
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.forward import DecodeGraphs
from rollout.request import SamplingParams
from rollout.sampler import sample

torch.manual_seed(0)
MODEL = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
SMALL = dict(memory_bytes=8 << 20, page_size=4, chunk_size=8, max_seq_len=256)
GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


def prompt(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_packed_prefill_equals_the_reference_and_packs_several_requests():
    prompts = [prompt(n, 30 + i) for i, n in enumerate([3, 17, 9, 30])]
    eng = Engine(MODEL, EngineConfig(max_prefill_tokens=64, **SMALL))
    ids = [eng.submit(p, GREEDY) for p in prompts]
    eng._admit()
    packed = []
    real_forward = eng._forward
    eng._forward = lambda batch, toks, lengths: packed.append(list(lengths)) or real_forward(batch, toks, lengths)
    done = {}
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
    assert max(len(lengths) for lengths in packed if any(t > 1 for t in lengths)) >= 3
    for i, p in zip(ids, prompts):
        want, want_lp = greedy_generate(MODEL, torch.tensor([p]), 6)
        assert done[i].output_ids == want[0].tolist()
        torch.testing.assert_close(torch.tensor(done[i].logprobs), want_lp[0], rtol=0, atol=1e-4)
    eng.check_invariants()


@pytest.mark.parametrize("compiled", [False, True])
def test_padded_bucketed_decode_equals_exact_decode(compiled):
    """The CUDA-graph shapes (batch padded with sink rows, history padded to a power of two) run eagerly;
    `compiled`: the same step through torch.compile (`EngineConfig.compile_decode`; inductor's CPU backend
    here, about a minute of compiling)."""
    prompts = [prompt(n, 40 + i) for i, n in enumerate([5, 12, 21])]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    plain = Engine(MODEL, EngineConfig(max_prefill_tokens=32, **SMALL)).generate(prompts, params)
    eng = Engine(MODEL, EngineConfig(max_prefill_tokens=32, max_running=6, **SMALL))
    eng.graphs = DecodeGraphs(MODEL, eng.kv, eng.states, max_batch=6, max_seq_len=256, capture=False,
                              compile=compiled)
    assert eng.graphs.batch_buckets == [1, 2, 4, 6] and eng.graphs.hist_buckets[0] == 64
    padded = eng.generate(prompts, params)
    for a, b in zip(plain, padded):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert not eng.states.recurrent[eng.states.kda_layers[0]][eng.states.allocator.capacity:].isnan().any()
    assert not eng.kv.buffers[eng.kv.mla_layers[0]][-eng.kv.page_size:].any(), "the zero page was written"
    eng.check_invariants()


def test_a_grpo_batch_of_short_prompts_prefills_in_one_forward():
    """256 samples of 32 short prompts (6-12 tokens): the default max_prefill_requests packs them into one
    prefill forward (16 per forward took 16), with the same outputs."""
    g = torch.Generator().manual_seed(0)
    prompts = [prompt(int(torch.randint(6, 13, (1,), generator=g)), 100 + i) for i in range(32) for _ in range(8)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=2, seed=i) for i in range(len(prompts))]
    outs, prefills = {}, {}
    for n in (16, EngineConfig.max_prefill_requests):
        eng = Engine(MODEL, EngineConfig(memory_bytes=64 << 20, max_prefill_tokens=4096, max_prefill_requests=n,
                                         max_running=256))
        lengths_seen = []
        real_forward = eng._forward
        eng._forward = lambda batch, toks, lengths: lengths_seen.append(list(lengths)) or real_forward(batch, toks,
                                                                                                        lengths)
        outs[n] = eng.generate(prompts, params)
        prefills[n] = sum(1 for lengths in lengths_seen if max(lengths) > 1)
    assert prefills == {16: 16, 256: 1}
    for a, b in zip(outs[16], outs[256]):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_graph_key_pads_into_a_larger_graph_until_a_bucket_is_asked_for_often_enough():
    eng = Engine(MODEL, EngineConfig(max_prefill_tokens=32, max_running=16, **SMALL))
    graphs = DecodeGraphs(MODEL, eng.kv, eng.states, max_batch=16, max_seq_len=256, capture=False, capture_after=3)
    assert graphs.graph_key(9, 10) == (12, 64)  # nothing captured: the exact bucket at once
    graphs.graphs[(12, 64)] = None
    assert [graphs.graph_key(3, 10) for _ in range(4)] == [(12, 64), (12, 64), (4, 64), (4, 64)]
    graphs.graphs[(4, 64)] = None
    assert graphs.graph_key(2, 10) == (4, 64)  # the smallest larger graph serves
    assert graphs.graph_key(2, 100) == (2, 128)  # no graph of that history bucket
    assert graphs.graph_key(14, 10) == (16, 64)  # nothing larger than 16
    assert graphs.graph_key(3, 10, (1, 2.0)) == (4, 64, 1, 2.0)  # another adapter key: its own graphs


def test_a_shrinking_batch_decodes_through_larger_graphs_exactly():
    """Requests stopping at different lengths shrink the batch through buckets 8 -> 4 -> 2 -> 1; a smaller
    bucket is served padded by a larger bucket's graph until asked for three times, and outputs equal the
    plain engine's."""
    prompts = [prompt(5 + 3 * i, 60 + i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_new_tokens=2 + 2 * i) for i in range(6)]
    plain = Engine(MODEL, EngineConfig(max_prefill_tokens=64, **SMALL)).generate(prompts, params)
    eng = Engine(MODEL, EngineConfig(max_prefill_tokens=64, max_running=8, **SMALL))
    eng.graphs = DecodeGraphs(MODEL, eng.kv, eng.states, max_batch=8, max_seq_len=256, capture=False)
    served = []  # (rows, graph key) per decode step
    real_key = eng.graphs.graph_key

    def graph_key(n, hist, slot_key=()):
        served.append((n, real_key(n, hist, slot_key)))
        return served[-1][1]

    eng.graphs.graph_key = graph_key
    padded = eng.generate(prompts, params)
    for a, b in zip(plain, padded):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # 75 prompt tokens over two prefill steps of 64: the last request joins the decode batch one step late
    assert [n for n, _ in served] == [6, 5, 5, 4, 4, 3, 3, 2, 2, 2, 1]
    # bucket 4's third ask (3 rows) captures it, bucket 2's third ask too; bucket 1, asked once, pads into 2
    assert [key[0] for _, key in served] == [8, 8, 8, 8, 8, 4, 4, 4, 4, 2, 2]
    assert sorted(eng.graphs.graphs) == [(2, 64), (4, 64), (8, 64)]
    assert (eng.graphs.captures, eng.graphs.replays) == (3, 11)
    eng.check_invariants()


def test_batched_sampler_truncation_seeds_and_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=1, seed=1),
              SamplingParams(temperature=1.3, top_p=0.3), SamplingParams(temperature=1.0, top_k=5, top_p=0.9)]
    gens = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    tokens, logps = sample(logits, params, gens)
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    for b, (t, p) in enumerate(zip(tokens, params)):
        temp = p.temperature or 1.0
        assert logps[b] == pytest.approx(float(torch.log_softmax(logits[b] / temp, -1)[t]), abs=1e-5)
    assert tokens[3] in logits[3].topk(5).indices.tolist()
    # top_p 0.3 keeps the smallest sorted prefix reaching 30% of the mass
    probs = torch.softmax(logits[2] / 1.3, -1)
    sp, order = probs.sort(descending=True)
    allowed = order[(sp.cumsum(0) - sp) < 0.3].tolist()
    draws = {sample(logits[2:3], params[2:3], [torch.Generator().manual_seed(s)])[0][0] for s in range(40)}
    assert draws <= set(allowed)
    # a seeded row's draw depends on its own generator only
    again = sample(logits.flip(0), params[::-1], [torch.Generator().manual_seed(2), None,
                                                   torch.Generator().manual_seed(1), None])[0]
    assert again[0] == tokens[3]


def test_sampler_frequencies_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(4000, 1)
    gens = [None] * 4000
    torch.manual_seed(0)
    tokens, _ = sample(logits, [SamplingParams(temperature=1.0)] * 4000, gens)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), rtol=0, atol=0.03)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, None)])
def test_padded_decode_with_adapter_and_mxfp4_equals_exact_decode(dtype, tol):
    """The CUDA-graph shapes with an adapter in the pool and MXFP4 experts (what an RL rollout decodes):
    sink rows take the batch's adapter slot; batches that mix adapters are not served by graphs."""
    from rollout.lora import LoraConfig
    from rollout.model_runner import build_engine_model

    state = {k: v.to(dtype) for k, v in MODEL.state_dict().items()}
    model, pool = build_engine_model(MODEL.config, state, quantize="experts", lora=LoraConfig(rank=8), dtype=dtype)
    g = torch.Generator().manual_seed(9)
    adapter = {}
    for name in pool.A:
        adapter[f"{name}.lora_A"] = (torch.randn(pool.A[name].shape[1:], generator=g) * 0.3).to(dtype)
        adapter[f"{name}.lora_B"] = (torch.randn(pool.B[name].shape[1:], generator=g) * 0.3).to(dtype)
    prompts = [prompt(n, 60 + i) for i, n in enumerate([5, 12, 21])]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)

    def run(graphs: bool):
        eng = Engine(model, EngineConfig(max_prefill_tokens=32, max_running=6, **SMALL), adapters=pool)
        if "policy" not in pool.names:
            eng.add_adapter("policy", adapter)
        if graphs:
            eng.graphs = DecodeGraphs(model, eng.kv, eng.states, max_batch=6, max_seq_len=256, capture=False,
                                      adapters=pool)
            real_run = eng.graphs.run
            eng.graphs.run = lambda *a: calls.append(len(a[0])) or real_run(*a)
        out = eng.generate(prompts, params, adapter="policy")
        eng.check_invariants()
        return eng, out

    calls: list[int] = []

    _, plain = run(False)
    eng, padded = run(True)
    assert 3 in calls and len(calls) >= 9  # the decode steps went through the padded path (3 rows -> bucket 4)
    for a, b in zip(plain, padded):
        if tol is None:  # bf16: batch padding changes GEMM blocking; the first tokens agree
            assert a.output_ids[:3] == b.output_ids[:3]
        else:
            assert a.output_ids == b.output_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=tol)
    pool.set_batch([1, 0], 1)  # rows with different adapters: eager
    assert not eng.graphs.usable(2, 10)
    pool.set_batch([1, 1], 1)
    assert eng.graphs.usable(2, 10)


def test_compile_decode_needs_the_cuda_graph_path():
    with pytest.raises(ValueError, match="compile_decode"):
        Engine(MODEL, EngineConfig(compile_decode=True, **SMALL))  # a CPU model: no graphs to compile
