"""The sharded engine (TP=2, two processes, gloo, fp32) replays the control calls and computes the same top
log-probs: rank 0 loads an adapter, generates with top log-probs, given ids' log-probs and prompt log-probs,
unloads the adapter and flushes the cache; the other rank follows (`Engine.REPLAYED`). Rank 0's answers equal
the single-process engine's, and both ranks end with the same accounting, both pools full."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_patches.parallel import end_world, free_port
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.model_runner import build_engine_model
from rollout.request import SamplingParams
from tests.rollout.test_engine_parallel import CONFIG, SETTINGS, SPEC, adapter, memory, prompts

ASK = SamplingParams(
    temperature=0.8, seed=3, max_new_tokens=5, top_logprobs=3, token_ids_logprob=(4, 8), logprob_start_len=2
)


def build(tp=None) -> Engine:
    from miles_k3.model.modeling import reference_state

    model, pool = build_engine_model(
        CONFIG,
        reference_state(CONFIG),
        quantize="none",
        lora=SPEC,
        max_adapters=2,
        dtype=torch.float32,
        **({} if tp is None else {"tp": tp}),
    )
    return Engine(model, EngineConfig(**memory(1), **SETTINGS), pool)


def workload(engine: Engine) -> list:
    ps = prompts()[:3] + prompts()[4:5]  # the length-1 prompt has no position 2
    engine.add_adapter("policy", adapter(1))
    first = engine.generate(ps, ASK, adapter="policy")
    engine.remove_adapter("policy")
    engine.flush_cache()
    second = engine.generate(ps, ASK)
    return [(c.output_ids, c.logprobs, c.top_logprobs, c.token_ids_logprobs, c.prompt.logprobs) for c in first + second]


def state(engine: Engine) -> dict:
    engine.check_invariants()
    return {
        "names": dict(engine.adapters.names),
        "free_pages": engine.kv.allocator.num_free,
        "capacity_pages": engine.kv.allocator.capacity,
        "free_slots": engine.states.allocator.num_free,
        "capacity_slots": engine.states.allocator.capacity,
        "trees": len(engine.memory.caches),
    }


def worker(rank: int, world: int, port: int, out: str) -> None:
    import faulthandler
    import os

    from rollout.parallel import EngineTP

    faulthandler.dump_traceback_later(240, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine = build(EngineTP())
        if engine.is_leader:
            answers = workload(engine)
            engine.flush_cache()
            engine.stop_followers()
        else:
            answers = None
            engine.follow()
        results = {"answers": answers, "state": state(engine)}
    finally:
        end_world()
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_tp_control")
    mp.spawn(worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_sharded_ranks_replay_unload_and_flush_and_compute_the_same_top_logprobs(runs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = build()
        want = workload(single)
    finally:
        torch.set_num_threads(threads)
    got = runs[0]["answers"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[0] == w[0]
        torch.testing.assert_close(torch.tensor(g[1]), torch.tensor(w[1]), rtol=0, atol=1e-4)
        assert [[t for t, _ in top] for top in g[2]] == [[t for t, _ in top] for top in w[2]]
        torch.testing.assert_close(
            torch.tensor([[v for _, v in top] for top in g[2]]),
            torch.tensor([[v for _, v in top] for top in w[2]]),
            rtol=0,
            atol=1e-4,
        )
        torch.testing.assert_close(torch.tensor(g[3]), torch.tensor(w[3]), rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(g[4]), torch.tensor(w[4]), rtol=0, atol=1e-4)
    a, b = runs[0]["state"], runs[1]["state"]
    assert a == b and a["names"] == {} and a["trees"] == 0
    assert a["free_pages"] == a["capacity_pages"] and a["free_slots"] == a["capacity_slots"]
