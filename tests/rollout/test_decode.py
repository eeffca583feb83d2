"""The decode pipeline: the overlap schedule gives the plain schedule's outputs, the decode-strategy seam is
called as documented, and padded (CUDA-graph-shaped) decode equals exact decode, its bucket policy included."""

import pytest
import torch

from miles_k3.model.lora_spec import LoraSpec
from rollout.config import EngineConfig
from rollout.decode import OneToken
from rollout.engine import Engine
from rollout.forward import DecodeGraphs
from rollout.model_runner import build_engine_model
from rollout.request import FinishReason, SamplingParams
from tests.rollout.common import MODEL, assert_pools_drain_to_full, engine, prompt


def padded_graphs(eng: Engine, max_batch: int, **kw) -> DecodeGraphs:
    """The CUDA-graph shapes (batch padded with sink rows, history padded to a power of two), run eagerly."""
    eng.graphs = DecodeGraphs(eng.model, eng.kv, eng.states, max_batch=max_batch, max_seq_len=256, capture=False, **kw)
    return eng.graphs


def test_overlapped_decode_gives_the_plain_schedule_outputs():
    """Overlap enqueues decode step k+1 from step k's device tokens before reading them: outputs, log-probs
    and finish reasons equal the plain schedule's, with stop tokens (a stopped request was fed one step
    more), length limits, admissions while decoding (max_running < requests), chunk-boundary snapshots
    during decode, and prefix hits afterwards. Pools return to full."""
    group = prompt(13, 40)
    prompts = [group] * 3 + [prompt(n, 41 + n) for n in (5, 9, 17)]
    greedy_ref = engine(overlap="off").generate([prompts[3]], SamplingParams(temperature=0, max_new_tokens=12))[0]
    stop = greedy_ref.output_ids[5]  # some requests stop early on it
    params = [SamplingParams(temperature=1.0, max_new_tokens=12 + i, seed=i, stop_token_ids=(stop,)) for i in range(3)]
    params += [
        SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)),
        SamplingParams(temperature=0.7, top_k=50, max_new_tokens=20, seed=7),
        SamplingParams(temperature=0, max_new_tokens=1),
    ]

    def run(overlap):
        eng = engine(overlap=overlap, max_running=4)
        ids = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
        done, launches = {}, 0
        while eng.has_work():
            done.update({c.request_id: c for c in eng.step()})
            launches += eng.decoder.inflight is not None
            eng.check_invariants()
        again = eng.generate(prompts, params)  # prefix hits on the tree the first round left
        assert sum(c.cached_tokens for c in again) > 0
        assert_pools_drain_to_full(eng)
        return [done[i] for i in ids], again, launches

    plain, plain_again, none = run("off")
    over, over_again, launches = run("on")
    assert none == 0 and launches > 10  # the overlapped run kept a step in flight most of the time
    assert plain[3].finish_reason == FinishReason.STOP and plain[3].output_ids[-1] == stop
    for a, b in zip(plain + plain_again, over + over_again):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_pipeline_calls_its_strategy_as_documented(overlap, monkeypatch):
    """`DecodeStrategy`'s contract, checked on the engine's strategy: `launch` gets rows whose pages cover
    [0, pos + lookahead), leaves the radix-cache locks alone and advances each row's pos by the token it fed;
    every launch is read exactly once, in launch order, and without overlap before the next launch."""
    eng = engine(overlap=overlap, max_running=2)
    strategy = eng.decoder.strategy
    assert isinstance(strategy, OneToken) and strategy.lookahead == 1
    page = eng.config.page_size
    launched, were_read = [], []
    real_launch, real_read = strategy.launch, strategy.read

    def launch(batch, ids):
        assert all(len(r.pages) * page >= r.pos + strategy.lookahead for r in batch)
        nodes, before = [r.node for r in batch], [r.pos for r in batch]
        out = real_launch(batch, ids)
        assert [r.node for r in batch] == nodes and [r.pos for r in batch] == [p + 1 for p in before]
        if overlap == "off":
            assert len(were_read) == len(launched)
        launched.append(out)
        return out

    def read(launch_):
        were_read.append(launch_)
        return real_read(launch_)

    monkeypatch.setattr(strategy, "launch", launch)
    monkeypatch.setattr(strategy, "read", read)
    prompts = [prompt(n, 70 + n) for n in (3, 11, 6)]  # the third is admitted while the others decode
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    outs = eng.generate(prompts, params)
    assert were_read == launched and len(launched) >= 6
    plain = engine(max_running=2).generate(prompts, params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]


@pytest.mark.parametrize("compiled", [False, True])
def test_padded_bucketed_decode_equals_exact_decode(compiled):
    """The CUDA-graph shapes run eagerly; `compiled`: the same step through torch.compile
    (`EngineConfig.compile_decode`; inductor's CPU backend here, about a minute of compiling)."""
    prompts = [prompt(n, 40 + i) for i, n in enumerate([5, 12, 21])]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    plain = engine(max_prefill_tokens=32).generate(prompts, params)
    eng = engine(max_prefill_tokens=32, max_running=6)
    graphs = padded_graphs(eng, 6, compile=compiled)
    assert graphs.batch_buckets == [1, 2, 4, 6] and graphs.hist_buckets[0] == 64
    padded = eng.generate(prompts, params)
    for a, b in zip(plain, padded):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert not eng.states.recurrent[eng.states.kda_layers[0]][eng.states.allocator.capacity :].isnan().any()
    assert not eng.kv.buffers[eng.kv.mla_layers[0]][-eng.kv.page_size :].any(), "the zero page was written"
    eng.check_invariants()


def test_graph_key_pads_into_a_larger_graph_until_a_bucket_is_asked_for_often_enough():
    eng = engine(max_prefill_tokens=32, max_running=16)
    graphs = DecodeGraphs(MODEL, eng.kv, eng.states, max_batch=16, max_seq_len=256, capture=False, capture_after=3)
    assert graphs.graph_key(9, 10) == (12, 64)  # nothing captured: the exact bucket at once
    graphs.graphs[(12, 64)] = None
    assert [graphs.graph_key(3, 10) for _ in range(4)] == [(12, 64), (12, 64), (4, 64), (4, 64)]
    graphs.graphs[(4, 64)] = None
    assert graphs.graph_key(2, 10) == (4, 64)  # the smallest larger graph serves
    assert graphs.graph_key(2, 100) == (2, 128)  # no graph of that history bucket or longer
    assert graphs.graph_key(14, 10) == (16, 64)  # nothing larger than 16
    assert graphs.graph_key(3, 10, (1, 2.0)) == (4, 64, 1, 2.0)  # another adapter key: its own graphs
    graphs.graphs[(16, 256)] = graphs.graphs[(2, 256)] = None
    assert graphs.graph_key(2, 100) == (2, 256)  # a longer history serves too, the smallest batch first
    assert graphs.graph_key(12, 10) == (12, 64)  # captured: exact
    assert graphs.graph_key(14, 70) == (16, 256)


def test_a_shrinking_batch_decodes_through_larger_graphs_exactly(monkeypatch):
    """Requests stopping at different lengths shrink the batch through buckets 8 -> 4 -> 2 -> 1; a smaller
    bucket is served padded by a larger bucket's graph until asked for three times, and outputs equal the
    plain engine's."""
    prompts = [prompt(5 + 3 * i, 60 + i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_new_tokens=2 + 2 * i) for i in range(6)]
    plain = engine(max_prefill_tokens=64).generate(prompts, params)
    eng = engine(max_prefill_tokens=64, max_running=8)
    graphs = padded_graphs(eng, 8)
    served = []  # (rows, graph key) per decode step
    real_key = graphs.graph_key

    def graph_key(n, hist, slot_key=()):
        served.append((n, real_key(n, hist, slot_key)))
        return served[-1][1]

    monkeypatch.setattr(graphs, "graph_key", graph_key)
    padded = eng.generate(prompts, params)
    for a, b in zip(plain, padded):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # 75 prompt tokens over two prefill steps of 64: the last request joins the decode batch one step late
    assert [n for n, _ in served] == [6, 5, 5, 4, 4, 3, 3, 2, 2, 2, 1]
    # bucket 4's third ask (3 rows) captures it, bucket 2's third ask too; bucket 1, asked once, pads into 2
    assert [key[0] for _, key in served] == [8, 8, 8, 8, 8, 4, 4, 4, 4, 2, 2]
    assert sorted(graphs.graphs) == [(2, 64), (4, 64), (8, 64)]
    assert (graphs.captures, graphs.replays) == (3, 11)
    assert eng.counters() == {"graph_captures": 3, "graph_replays": 11, "retractions": 0}
    eng.check_invariants()


def test_a_graph_of_a_longer_history_serves_a_shorter_one_exactly():
    """A captured (batch 8, history 256) graph serves every step of a small, short batch (its padded history
    reads the zero page, masked by position) until a bucket has been asked for three times; outputs equal
    the plain engine's."""
    prompts = [prompt(5 + 4 * i, 70 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    plain = engine(max_prefill_tokens=64).generate(prompts, params)
    eng = engine(max_prefill_tokens=64, max_running=8)
    graphs = padded_graphs(eng, 8)
    graphs.graphs[(8, 256)] = None
    padded = eng.generate(prompts, params)
    for a, b in zip(plain, padded):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert sorted(graphs.graphs) == [(4, 64), (8, 256)]  # (4, 64) captured on its third ask
    assert (graphs.captures, graphs.replays) == (1, 6)  # the overlap schedule feeds one step past the limit
    eng.check_invariants()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, None)])
def test_padded_decode_with_adapter_and_mxfp4_equals_exact_decode(dtype, tol, monkeypatch):
    """The CUDA-graph shapes with an adapter in the pool and MXFP4 experts (what an RL rollout decodes):
    sink rows take the batch's adapter slot; batches that mix adapters are not served by graphs."""
    state = {k: v.to(dtype) for k, v in MODEL.state_dict().items()}
    model, pool = build_engine_model(MODEL.config, state, quantize="experts", lora=LoraSpec(rank=8), dtype=dtype)
    g = torch.Generator().manual_seed(9)
    adapter = {}
    for name in pool.A:
        adapter[f"{name}.lora_A"] = (torch.randn(pool.A[name].shape[1:], generator=g) * 0.3).to(dtype)
        adapter[f"{name}.lora_B"] = (torch.randn(pool.B[name].shape[1:], generator=g) * 0.3).to(dtype)
    prompts = [prompt(n, 60 + i) for i, n in enumerate([5, 12, 21])]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)

    def run(graphs: bool):
        eng = engine(model=model, adapters=pool, max_prefill_tokens=32, max_running=6)
        if "policy" not in pool.names:
            eng.add_adapter("policy", adapter)
        if graphs:
            real_run = padded_graphs(eng, 6, adapters=pool).run
            monkeypatch.setattr(eng.graphs, "run", lambda *a: calls.append(len(a[0])) or real_run(*a))
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


def test_graphs_are_dropped_and_rebuilt_with_the_pools_and_counted_across():
    eng = engine(max_prefill_tokens=32, max_running=4)
    padded_graphs(eng, 4)
    eng.generate([prompt(7, 80)], SamplingParams(temperature=0, max_new_tokens=5))
    once = eng.counters()
    assert once["graph_replays"] > 0
    eng.release_memory()
    assert eng.graphs is None and eng.counters() == once
    eng.resume_memory()
    assert eng.graphs is None  # a CPU engine builds none; its pools are new
    padded_graphs(eng, 4)
    eng.generate([prompt(7, 80)], SamplingParams(temperature=0, max_new_tokens=5))
    assert eng.counters()["graph_replays"] == 2 * once["graph_replays"]


def test_compile_decode_needs_the_cuda_graph_path():
    with pytest.raises(ValueError, match="compile_decode"):
        Engine(MODEL, EngineConfig(memory_bytes=8 << 20, compile_decode=True))  # a CPU model: no graphs to compile
