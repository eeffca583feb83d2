"""Trainer <-> engine: adapter sync equality by checksum, train-vs-rollout log-prob agreement in BF16-base
mode, and the measured MXFP4 gap."""

import pytest
import torch

from megatron_patches.parallel import ensure_parallel
from miles_k3.trainer.base import build_tokenizer, load_base
from miles_k3.trainer.batch import TrainBatch
from miles_k3.trainer.resolve import resolve
from miles_k3.trainer.workers import build_rollout_worker, build_train_worker
from rollout.request import SamplingParams
from tests.trainer.recipes import composed, fresh


@pytest.fixture(scope="module")
def setup():
    ensure_parallel()
    rc = resolve(composed("optim.lr=5e-2"))  # a visible update in one step
    config, state = load_base(rc.model, 0)
    tok = build_tokenizer(rc.model, config)
    return rc, config, state, tok


def rollouts(engine, tok, n=8, seed=0):
    prompts = [tok.encode_prompt(p) for p in ["12+7=", "40-9=", "3+3=", "77-70="] for _ in range(n // 4)]
    params = [
        SamplingParams(max_new_tokens=5, stop_token_ids=(tok.eos_token_id,), seed=seed + i) for i in range(len(prompts))
    ]
    outs = engine.generate(fresh(prompts), params)
    adv = torch.randn(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    return TrainBatch.of(
        prompts, [o.output_ids for o in outs], [o.logprobs for o in outs], adv, [i // 2 for i in range(len(prompts))]
    )


@pytest.mark.parametrize("overlap", ["off", "on"])  # "on": the schedule a CUDA rollout uses
def test_sync_equality_and_logprob_agreement_after_an_update(setup, overlap):
    rc, config, state, tok = setup
    trainer = build_train_worker(rc, config, state, "cpu")
    engine = build_rollout_worker(resolve(composed(f"rollout.overlap={overlap}")), config, state, "cpu")
    engine.sync_adapter(trainer.adapter_state())
    batch = rollouts(engine, tok)
    metrics = trainer.train(batch)
    assert metrics["grad_norm"] > 0
    tensors = trainer.adapter_state()
    assert any(float(t.abs().sum()) > 0 for k, t in tensors.items() if k.endswith("lora_B"))
    engine.release_memory()
    engine.resume_memory()
    pool = engine.engine.adapters
    storage = {k: a.data_ptr() for k, a in pool.A.items()}
    engine.sync_adapter(tensors)
    assert {k: a.data_ptr() for k, a in pool.A.items()} == storage  # in place
    expected = {k: float(t.double().sum()) for k, t in tensors.items()}
    assert engine.adapter_checksum() == pytest.approx(expected, rel=0, abs=0)
    # the updated policy: the engine's sampled log-probs equal the trainer's recomputation
    batch = rollouts(engine, tok, seed=100)
    got = trainer.logprobs(batch)
    diffs = [abs(a - b) for lp_t, lp_e in zip(got, batch.rollout_logprobs) for a, b in zip(lp_t, lp_e)]
    assert max(diffs) < 1e-4, max(diffs)


def test_mxfp4_engine_gap_is_measured_and_bounded(setup):
    rc, config, state, tok = setup
    trainer = build_train_worker(rc, config, state, "cpu")
    rc_fp4 = resolve(composed("rollout.quantize=experts"))
    engine = build_rollout_worker(rc_fp4, config, state, "cpu")
    engine.sync_adapter(trainer.adapter_state())
    batch = rollouts(engine, tok, n=16, seed=7)
    got = trainer.logprobs(batch)
    diffs = [abs(a - b) for lp_t, lp_e in zip(got, batch.rollout_logprobs) for a, b in zip(lp_t, lp_e)]
    mean = sum(diffs) / len(diffs)
    print(f"MXFP4 experts vs BF16 trainer: mean |dlogp| {mean:.4f}, max {max(diffs):.4f}")
    assert 1e-5 < mean < 0.1  # MXFP4 changes the model (not 0) by a bounded amount


def test_several_updates_per_step_use_the_pre_update_policy_as_old(setup):
    rc, config, state, tok = setup
    rc2 = resolve(composed("optim.lr=5e-2", "algo.updates_per_step=2"))
    trainer = build_train_worker(rc2, config, state, "cpu")
    engine = build_rollout_worker(rc2, config, state, "cpu")
    engine.sync_adapter(trainer.adapter_state())
    batch = rollouts(engine, tok, n=16, seed=3)
    metrics = trainer.train(batch)
    # the first minibatch starts at ratio 1; the second sees the policy moved by the first update
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    assert metrics["approx_kl"] > 0 and metrics["lr"] == pytest.approx(5e-2)


def test_engine_counters_add_up_across_a_release(setup):
    """The worker's graph / retraction counters cover every generate since it was built, although the
    engine's graphs (and their counters) are dropped with the pools on release. CPU: the graphs run at the
    padded shapes without capturing (`capture=False`), counted the same way."""
    from rollout.forward import DecodeGraphs

    rc, config, state, tok = setup
    worker = build_rollout_worker(rc, config, state, "cpu")
    worker.sync_adapter(build_train_worker(rc, config, state, "cpu").adapter_state())

    def padded_graphs():
        e = worker.engine
        e.graphs = DecodeGraphs(
            e.model,
            e.kv,
            e.states,
            max_batch=e.config.max_running,
            capture=False,
            max_seq_len=e.config.max_seq_len,
            adapters=e.adapters,
        )
        return e.graphs

    first = padded_graphs()
    rollouts(worker, tok)
    assert first.captures > 0 and first.replays > first.captures
    once = worker.engine_counters()
    assert once == {"graph_captures": first.captures, "graph_replays": first.replays, "retractions": 0}
    worker.release_memory()
    worker.resume_memory()
    second = padded_graphs()
    rollouts(worker, tok, seed=5)
    assert worker.engine_counters() == {
        "graph_captures": once["graph_captures"] + second.captures,
        "graph_replays": once["graph_replays"] + second.replays,
        "retractions": 0,
    }
