"""Unified memory (`EngineConfig.unified_memory`): one byte pool, KDA slots from the bottom and KV pages from
the top. The arena's moves keep every live block's bytes and rename its id everywhere; pins hold blocks in
place; the pools' per-layer tensors are fixed views into it; the engine over it gives the two-pool engine's
outputs under a fuzzed request stream and drains back to full."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_k3.model import K3Config
from rollout.cache_manager import CacheManager
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.memory import KDAStatePool, KVPagePool, OutOfSlots, PoolSizes
from rollout.request import Request, SamplingParams
from rollout.unified_memory import UnifiedArena
from tests.rollout.common import GREEDY, ROOMY, SMALL, assert_pools_drain_to_full, drain, engine, prompt

CONFIG = K3Config.from_preset("k3-tiny")
KINDS = ("slots", "pages")


class Holders:
    """A model of the arena's holders: id -> a tag whose bytes the block must keep, renamed on moves."""

    def __init__(self, arena: UnifiedArena):
        self.arena = arena
        self.held = {kind: {} for kind in KINDS}  # kind -> {id: tag}
        self.renames = 0
        arena.on_move = self.moved

    def moved(self, kind: str, moves: dict[int, int]) -> None:
        held = self.held[kind]
        assert not set(moves) & self.arena.pinned(kind), "a pinned block moved"
        assert set(moves) <= set(held), "moved a block nobody holds"
        assert not set(moves.values()) & (set(held) - set(moves)), "moved onto a live block"
        self.held[kind] = {moves.get(i, i): tag for i, tag in held.items()}
        self.renames += len(moves)

    def alloc(self, kind: str, n: int, rng: random.Random) -> None:
        for i in self.arena.alloc(kind, n):
            tag = rng.randrange(1, 256)
            self.arena.blocks(kind)[i].fill_(tag)
            self.held[kind][i] = tag

    def check(self) -> None:
        a = self.arena
        a.check()
        for kind in KINDS:
            blocks = a.blocks(kind)
            for i, tag in self.held[kind].items():
                assert not a.is_free(kind, i)
                assert bool((blocks[i] == tag).all()), f"{kind} {i} lost its bytes"
            assert a.num_live(kind) == len(self.held[kind])
        # one free region: the live blocks of each kind are its region exactly (plus holes behind a pin)
        slots, pages = a._regions["slots"], a._regions["pages"]
        assert a.low_end == a.bottom + slots.extent * a.slot_bytes
        assert a.high_start == a.top - pages.extent * a.page_bytes
        assert a.free_bytes >= 0
        for kind, region in a._regions.items():
            assert {region.id_of(k) for k in range(region.extent)} - set(self.held[kind]) == {
                region.id_of(k) for k in region.holes
            }
        # the fixed blocks: the zero page is zero, nothing handed out overlaps them
        assert not a.page_blocks[a.zero_page].any()


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1))
def test_moves_keep_every_live_blocks_bytes_and_rename_it_for_its_holder(seed):
    rng = random.Random(seed)
    arena = UnifiedArena(
        rng.randrange(3000, 9000),
        slot_bytes=rng.choice([160, 320, 480]),
        page_bytes=rng.choice([16, 48, 96]),
        device="cpu",
    )
    h = Holders(arena)
    for _ in range(150):
        kind = rng.choice(KINDS)
        held = h.held[kind]
        op = rng.random()
        if op < 0.45:
            n = rng.randrange(1, 4)
            if n <= arena.num_free(kind):
                h.alloc(kind, n, rng)
            else:
                with pytest.raises(OutOfSlots):
                    arena.alloc(kind, n)
        elif op < 0.8 and held:
            victims = rng.sample(sorted(held), rng.randrange(1, min(3, len(held)) + 1))
            for i in victims:
                del held[i]
            arena.free(kind, victims)
        elif op < 0.9 and held:
            unpinned = sorted(set(held) - arena.pinned(kind))
            if unpinned:
                arena.pin(kind, [rng.choice(unpinned)])
        elif arena.pinned(kind):
            arena.unpin(kind, [rng.choice(sorted(arena.pinned(kind)))])
        h.check()
        if not arena.pinned("slots") and not arena.pinned("pages"):
            assert not arena._regions["slots"].holes and not arena._regions["pages"].holes, "not compacted"
    for kind in KINDS:  # everything back: one free region of the whole budget
        arena.unpin(kind, sorted(arena.pinned(kind)))
        arena.free(kind, sorted(h.held[kind]))
        h.held[kind] = {}
    h.check()
    assert arena.free_bytes == arena.budget


def test_a_pinned_end_block_stays_put_and_leaves_holes_the_next_allocation_fills():
    arena = UnifiedArena(2000, slot_bytes=160, page_bytes=32, device="cpu")
    h = Holders(arena)
    rng = random.Random(0)
    h.alloc("slots", 4, rng)
    assert sorted(h.held["slots"]) == [1, 2, 3, 4]
    arena.pin("slots", [4])
    del h.held["slots"][1], h.held["slots"][2]
    arena.free("slots", [1, 2])
    h.check()
    assert h.renames == 0 and arena._regions["slots"].holes == {0, 1}  # 4 is pinned at the end
    h.alloc("slots", 1, rng)
    assert 1 in h.held["slots"] and arena.num_free("slots") == 1 + arena.free_bytes // 160
    arena.unpin("slots", [4])  # compaction resumes: 4 moves into the hole at 2
    h.check()
    assert sorted(h.held["slots"]) == [1, 2, 3] and h.renames == 1
    arena.pin("slots", [3])
    del h.held["slots"][3]
    arena.free("slots", [3])  # freeing a pinned block ends its pin
    assert not arena.pinned("slots") and arena._regions["slots"].extent == 2
    h.check()


def test_deferring_leaves_holes_without_moves_until_settle():
    arena = UnifiedArena(2000, slot_bytes=160, page_bytes=32, device="cpu")
    h = Holders(arena)
    h.alloc("pages", 6, random.Random(1))
    arena.deferring = True  # the middle of a decode step: ids held on the host must stay valid
    victims = sorted(h.held["pages"])[3:5]
    for i in victims:
        del h.held["pages"][i]
    arena.free("pages", victims)
    arena.settle()  # still deferring: nothing moves
    h.check()
    assert h.renames == 0 and len(arena._regions["pages"].holes) == 2
    arena.deferring = False
    arena.settle()
    h.check()
    assert h.renames == 2 and not arena._regions["pages"].holes and not arena.pending["pages"]


def test_each_kind_takes_the_free_region_the_other_leaves():
    arena = UnifiedArena(1600, slot_bytes=160, page_bytes=32, device="cpu")
    assert arena.num_free("slots") == 10 and arena.num_free("pages") == 50
    pages = arena.alloc("pages", 45)  # 1440 B: room for one slot
    assert arena.num_free("slots") == 1
    with pytest.raises(OutOfSlots, match="kda state slots: asked for 2, 1 free"):
        arena.alloc("slots", 2)
    arena.free("pages", pages[:20])
    assert arena.num_free("slots") == 5 and arena.num_free("pages") == 25
    assert set(arena.alloc("slots", 5)) == {1, 2, 3, 4, 5} and arena.num_free("pages") == 0


def test_pool_tensors_are_fixed_views_of_the_blocks_for_every_rank_share():
    for tp, dcp in [(1, 1), (2, 1), (1, 2)]:
        sizes = PoolSizes.unified(CONFIG, 600_000, page_size=4, dtype=torch.float32, tp_size=tp, dcp_size=dcp)
        assert sizes.kda_heads == CONFIG.kda_num_heads // tp and sizes.kv_rows_per_page == 4 // dcp
        arena = UnifiedArena(600_000, sizes.slot_bytes, sizes.page_bytes, "cpu")
        kv = KVPagePool(CONFIG, sizes, torch.float32, "cpu", arena)
        states = KDAStatePool(CONFIG, sizes, torch.float32, "cpu", arena)
        assert kv.allocator is arena.pages and states.allocator is arena.slots
        assert (kv.sink_page, kv.zero_page, states.sink_slot) == (arena.max_pages, arena.max_pages + 1, 0)
        layer = kv.mla_layers[1]
        assert kv.buffers[layer].shape == ((arena.max_pages + 2) * sizes.kv_rows_per_page, 48)
        assert states.recurrent[states.kda_layers[0]].shape == (arena.max_slots + 1, sizes.kda_heads, 32, 32)
        ptrs = [t.data_ptr() for t in [*kv.buffers.values(), *states.recurrent.values(), *states.conv.values()]]
        # every byte of a page / slot belongs to exactly one (layer, row) of the views
        page = kv.allocator.alloc(1)[0]
        rows = torch.arange(page * kv.rows_per_page, (page + 1) * kv.rows_per_page)
        for i, buf in enumerate(kv.buffers.values()):
            buf[rows] = float(i + 1)
        assert torch.equal(arena.page_blocks[page].view(torch.float32).unique(), torch.tensor([1.0, 2.0]))
        slot = states.allocator.alloc(1)[0]
        for i, t in enumerate([*states.recurrent.values(), *states.conv.values()]):
            t[slot] = float(i + 1)
        used = arena.slot_blocks[slot].view(torch.float32)[: PoolSizes.bytes_per_slot(CONFIG, torch.float32, tp) // 4]
        assert torch.equal(used.unique(), torch.arange(1.0, 9.0))
        # a move carries every layer's rows; the views do not change address
        other = kv.allocator.alloc(1)[0]
        kv.buffers[layer][other * kv.rows_per_page] = 7.0
        kv.allocator.free([page])  # `other` (the region's end) moves into page's place
        assert float(kv.buffers[layer][page * kv.rows_per_page, 0]) == 7.0
        assert ptrs == [t.data_ptr() for t in [*kv.buffers.values(), *states.recurrent.values(), *states.conv.values()]]
        states.copy_slots([slot], [states.sink_slot])
        assert torch.equal(states.recurrent[states.kda_layers[3]][0], states.recurrent[states.kda_layers[3]][slot])
        states.zero_slots([slot])
        assert not arena.slot_blocks[slot].any()


def manager(memory: int) -> CacheManager:
    return CacheManager(
        CONFIG, EngineConfig(memory_bytes=memory, unified_memory=True, **SMALL), torch.float32, torch.device("cpu")
    )


def test_eviction_crosses_the_boundary_both_ways():
    # pages need room: the tree's pages are locked (a running request's prefix), so checkpoints give it
    mem = manager(400_000)  # 4 slots at most
    tree, arena = mem.cache_for(None), mem.arena
    toks = prompt(32, 1)
    res = tree.insert(toks, arena.pages.alloc(8), dict(zip((8, 16, 24), arena.slots.alloc(3))))
    tree.lock(res.node)
    r = mem.admit(Request(prompt(40, 2), GREEDY), prompt(40, 2), mem.match(None, prompt(40, 2)))
    assert r is not None and len(r.pages) == 10  # the prompt's pages come with the slot
    assert not mem.grow(r, 1200) and tree.stats()["checkpoints"] == 0 and tree.stats()["pages"] == 8
    assert mem.grow(r, 4 * (len(r.pages) + arena.num_free("pages")))  # what the evicted checkpoints left
    mem.check([r], set())
    tree.unlock(res.node)
    mem.release(r)
    # slots need room: unlocked tree pages give it
    toks = prompt(200, 3)
    tree.insert(toks, arena.pages.alloc(50), {})
    arena.pages.alloc(arena.num_free("pages"))  # the rest of the arena: taken, so only the tree can give
    before = tree.stats()["pages"]
    r = mem.admit(Request(prompt(4, 4), GREEDY), prompt(4, 4), mem.match(None, prompt(4, 4)))
    assert r is not None and tree.stats()["pages"] < before


def unified(memory: int = ROOMY, **kw) -> Engine:
    return engine(memory=memory, unified_memory=True, **kw)


def test_greedy_outputs_equal_the_two_pool_engine_with_prefix_hits():
    prompts = [prompt(n, i) for i, n in enumerate([1, 9, 30])]
    prompts.append(prompts[2][:20] + prompt(5, 50))  # a branch of the 30-token prompt
    eng = unified(400_000)  # 4 slots at most: checkpoints and pages evict each other
    # the batch, then the 30-token prompt alone (it plants its checkpoints), then again (it restores one)
    got = eng.generate(prompts, GREEDY) + eng.generate(prompts[2:3], GREEDY) + eng.generate(prompts[2:3], GREEDY)
    for want, out in zip(engine().generate(prompts + prompts[2:3] * 2, GREEDY), got):
        assert out.output_ids == want.output_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-4)
    assert got[-1].cached_tokens > 0 and eng.memory.arena.moves > 0  # the repeat restored a checkpoint
    assert_pools_drain_to_full(eng)
    assert eng.memory.arena.free_bytes == eng.memory.arena.budget


def test_a_request_that_cannot_fit_gets_the_two_pool_error_and_one_that_just_fits_runs_alone():
    eng = unified(100_000)  # one 83,968 B slot next to 10 pages of 4 tokens
    assert eng.memory.sizes.num_pages == (100_000 - eng.memory.sizes.slot_bytes) // eng.memory.sizes.page_bytes == 10
    with pytest.raises(ValueError, match="request needs 11 KV pages but the pool holds 10"):
        eng.submit(prompt(31, 1), GREEDY)
    p = prompt(30, 1)
    eng.submit(p, GREEDY)
    eng.submit(prompt(12, 2), GREEDY)  # waits for the slot
    done = drain(eng)
    assert done[min(done)].output_ids == engine().generate([p], GREEDY)[0].output_ids
    assert_pools_drain_to_full(eng)
    with pytest.raises(ValueError, match="need at least one of each"):
        unified(80_000)


def test_at_equal_bytes_the_arena_holds_what_either_fixed_split_holds():
    two = engine(memory=700_000).memory.sizes  # state_fraction 0.5
    one = unified(700_000).memory.sizes
    assert one.num_slots > two.num_slots and one.num_pages > two.num_pages


@pytest.mark.parametrize("overlap", ["off", "on"])
@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), memory=st.sampled_from([200_000, 360_000, 700_000]))
def test_fuzz_streams_keep_the_accounting_and_give_the_two_pool_outputs(overlap, seed, memory):
    """test_engine's fuzz over the arena: shared prefixes, aborts and memory pressure, `check_invariants`
    (the arena's layout and pins too) after every step; every request that was not aborted finishes with
    the greedy tokens and log-probs of a roomy two-pool engine, and the pools drain back to full."""
    rng = random.Random(seed)
    eng = unified(memory, overlap=overlap)
    bases = [prompt(30, 100 + i) for i in range(3)]
    submitted: dict[int, tuple[list[int], SamplingParams]] = {}
    aborted, done = set(), {}
    for _ in range(30):
        if len(submitted) < 8 and rng.random() < 0.4:
            p = rng.choice(bases)[: rng.randrange(1, 30)] + prompt(rng.randrange(0, 6), rng.randrange(10**6))
            params = SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, 8))
            submitted[eng.submit(p, params)] = (p, params)
        elif eng.scheduler.running and rng.random() < 0.1:
            rid = rng.choice(eng.scheduler.running).req.request_id
            eng.abort(rid)
            aborted.add(rid)
        done.update((c.request_id, c) for c in eng.step())
        eng.check_invariants()
    for _ in range(2000):  # a livelock (requests retracting each other forever) fails instead of hanging
        if not eng.has_work():
            break
        done.update((c.request_id, c) for c in eng.step())
        eng.check_invariants()
    assert not eng.has_work(), "engine made no progress"
    assert set(done) | aborted == set(submitted), "a request was lost"
    finished = sorted(set(submitted) - aborted)
    wants = engine().generate([submitted[r][0] for r in finished], [submitted[r][1] for r in finished])
    for rid, want in zip(finished, wants):
        assert done[rid].output_ids == want.output_ids
        torch.testing.assert_close(torch.tensor(done[rid].logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-4)
    assert_pools_drain_to_full(eng)
    assert eng.memory.arena.free_bytes == eng.memory.arena.budget


def test_unified_memory_false_builds_the_two_pools():
    eng = engine(memory=700_000)
    assert eng.memory.arena is None and type(eng.kv.allocator).__name__ == "IndexAllocator"
    assert eng.kv.buffers[eng.kv.mla_layers[0]].is_contiguous()
    assert EngineConfig(memory_bytes=1).unified_memory is False
