"""The scheduler's plans, seen through the engine: prefix hits and branch points, packed prefill, GRPO groups
computing their prompt once, and retraction under memory pressure; outputs always equal cold runs."""

import pytest
import torch

from miles_k3.model.generate import greedy_generate
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import SamplingParams
from tests.rollout.common import GREEDY, MODEL, TIGHT, assert_pools_drain_to_full, cold, drain, engine, prompt


def record_prefills(eng, monkeypatch) -> list[list[int]]:
    """The per-request token counts of every forward the engine runs from now on (decode: all ones)."""
    seen: list[list[int]] = []
    real = eng.runner.forward
    monkeypatch.setattr(
        eng.runner, "forward", lambda batch, ids, lengths: seen.append(list(lengths)) or real(batch, ids, lengths)
    )
    return seen


def test_prefix_hit_gives_exactly_the_cold_output():
    eng = engine()
    p = prompt(37, 1)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=12)
    first = eng.generate([p], params)[0]
    again = eng.generate([p], params)[0]
    assert first.cached_tokens == 0 and again.cached_tokens == 32  # deepest chunk checkpoint below 37
    assert again.output_ids == first.output_ids == cold(p, params).output_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    eng.check_invariants()


def test_branch_point_is_planted_and_reused():
    eng = engine(max_prefill_tokens=32)
    base = prompt(40, 2)
    eng.generate([base], GREEDY)
    b = base[:21] + prompt(10, 3)  # diverges mid-edge at 21 -> fork at 16
    out_b = eng.generate([b], GREEDY)[0]
    assert out_b.cached_tokens == 0  # no checkpoint at or above the fork yet: replay from 0, plant at 16
    c = base[:19] + prompt(6, 4)
    out_c = eng.generate([c], GREEDY)[0]
    assert out_c.cached_tokens == 16
    assert out_b.output_ids == cold(b, GREEDY).output_ids and out_c.output_ids == cold(c, GREEDY).output_ids


def test_packed_prefill_equals_the_reference_and_packs_several_requests(monkeypatch):
    prompts = [prompt(n, 30 + i) for i, n in enumerate([3, 17, 9, 30])]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    eng = engine(max_prefill_tokens=64)
    ids = [eng.submit(p, params) for p in prompts]
    packed = record_prefills(eng, monkeypatch)
    done = drain(eng)
    assert max(len(lengths) for lengths in packed if any(t > 1 for t in lengths)) >= 3
    for i, p in zip(ids, prompts):
        want, want_lp = greedy_generate(MODEL, torch.tensor([p]), 6)
        assert done[i].output_ids == want[0].tolist()
        torch.testing.assert_close(torch.tensor(done[i].logprobs), want_lp[0], rtol=0, atol=1e-4)
    eng.check_invariants()


def test_a_packed_prefill_copies_its_rows_checkpoints_in_one_call_and_later_requests_hit_them(monkeypatch):
    """Four prompts of 16 tokens (chunk 8) in one 64-token prefill: every row ends on a chunk boundary, and
    their snapshots are one copy call (one gather per pool tensor, not one per row); a request that shares
    each prompt then restores the checkpoint it took and decodes exactly as a cold run."""
    prompts = [prompt(16, 50 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_new_tokens=3)
    eng = engine(max_prefill_tokens=64)
    calls = []
    real = eng.states.copy_slots
    monkeypatch.setattr(eng.states, "copy_slots", lambda src, dst: calls.append(len(src)) or real(src, dst))
    eng.generate(prompts, params)
    assert calls[0] == 4  # the prefill's four snapshots, one call
    longer = [p + prompt(5, 60 + i) for i, p in enumerate(prompts)]
    done = eng.generate(longer, params)
    for p, c in zip(longer, done):
        assert c.cached_tokens == 16 and c.output_ids == cold(p, params).output_ids
    eng.check_invariants()


def test_a_batch_short_of_snapshot_slots_evicts_the_checkpoints_it_lacks_in_one_pass(monkeypatch):
    """A state pool full of older prompts' checkpoints: rows reaching a chunk boundary together take their
    snapshot slots by one eviction pass over the tree for the whole shortfall, not one pass per row (a pass
    walks every node: at batch 512 a pass per row made a boundary step 0.9 s), and decode exactly as cold."""
    from rollout.radix_cache import HybridRadixCache

    eng = engine(memory=2 * 16 * 83_968 + 4096, state_fraction=0.5)
    assert eng.states.allocator.capacity == 16
    eng.generate([prompt(20, 300 + i) for i in range(6)], SamplingParams(temperature=0, max_new_tokens=1))
    passes, calls = [], []
    evict, snapshots = HybridRadixCache.evict_checkpoints, eng.memory.snapshots
    monkeypatch.setattr(HybridRadixCache, "evict_checkpoints", lambda cache, n: passes.append(n) or evict(cache, n))

    def counted(rows):
        before = len(passes)
        out = snapshots(rows)
        calls.append((len(rows), len(passes) - before, sum(s is not None for s in out)))
        return out

    monkeypatch.setattr(eng.memory, "snapshots", counted)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    prompts = [prompt(12, 400 + i) for i in range(6)]
    done = eng.generate(prompts, params)
    assert all(n_passes <= 1 for _, n_passes, _ in calls)
    assert any(rows > 1 and n_passes == 1 and got == rows for rows, n_passes, got in calls)  # the path ran
    for p, c in zip(prompts, done):
        assert c.output_ids == cold(p, params).output_ids
    assert_pools_drain_to_full(eng)


def test_a_grpo_batch_of_short_prompts_prefills_in_one_forward(monkeypatch):
    """256 samples of 32 short prompts (6-12 tokens): the default max_prefill_requests packs them into one
    prefill forward (16 per forward took 16), with the same outputs."""
    g = torch.Generator().manual_seed(0)
    prompts = [prompt(int(torch.randint(6, 13, (1,), generator=g)), 100 + i) for i in range(32) for _ in range(8)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=2, seed=i) for i in range(len(prompts))]
    outs, prefills = {}, {}
    for n in (16, EngineConfig.max_prefill_requests):
        eng = Engine(
            MODEL, EngineConfig(memory_bytes=64 << 20, max_prefill_tokens=4096, max_prefill_requests=n, max_running=256)
        )
        lengths_seen = record_prefills(eng, monkeypatch)
        outs[n] = eng.generate(prompts, params)
        prefills[n] = sum(1 for lengths in lengths_seen if max(lengths) > 1)
    assert prefills == {16: 16, 256: 1}
    for a, b in zip(outs[16], outs[256]):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_grpo_group_shares_the_prompt_up_to_its_last_chunk_boundary():
    eng = engine(max_prefill_tokens=32)
    p = prompt(45, 20)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    first = eng.submit(p, params)
    while not any(r.req.output_ids for r in eng.scheduler.running if r.req.request_id == first):
        eng.step()
    followers = [eng.submit(p, SamplingParams(temperature=1.0, max_new_tokens=4, seed=s)) for s in range(3)]
    done = drain(eng)
    assert [done[f].cached_tokens for f in followers] == [40, 40, 40]  # 45 tokens, chunk 8: boundary 40
    computed = sum(len(p) - done[i].cached_tokens for i in [first, *followers])
    assert computed <= (1 / 4 + 0.1) * 4 * len(p)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_group_submitted_together_computes_its_prompt_once(overlap):
    """GRPO submits n samples of a prompt at once: the first prefills, the others wait (in order) until
    it has donated the shared chunks, then restore there. Outputs equal cold runs; a prompt shorter than
    a chunk, or a different prompt, does not wait."""
    eng = engine(max_prefill_tokens=32, overlap=overlap)
    long_a, long_b, short = prompt(45, 30), prompt(30, 31), prompt(6, 32)
    prompts = [long_a] * 4 + [long_b] * 3 + [short] * 2
    params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=s) for s in range(len(prompts))]
    outs = eng.generate(prompts, params)
    assert [o.cached_tokens for o in outs] == [0, 40, 40, 40, 0, 24, 24, 0, 0]  # chunk 8: 44 -> 40, 29 -> 24
    for p, sp, o in zip(prompts, params, outs):
        assert o.output_ids == cold(p, sp).output_ids
    eng.check_invariants()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_retraction_under_memory_pressure_loses_and_duplicates_nothing(overlap):
    prompts = [prompt(20, 10 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_new_tokens=24)
    eng = engine(**TIGHT, overlap=overlap)
    outs = eng.generate(prompts, params)
    assert eng.counters()["retractions"] > 0
    for p, out in zip(prompts, outs):
        assert out.output_ids == cold(p, params).output_ids
    assert_pools_drain_to_full(eng)
