"""Hybrid radix cache: hits only at KDA checkpoints, branch points, duplicates, caps, eviction, fuzz."""

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.memory import IndexAllocator, OutOfSlots
from rollout.radix_cache import HybridRadixCache


def make(pages=64, slots=16, page_size=4, chunk=8, cap=4):
    pa, sa = IndexAllocator(pages, "pages"), IndexAllocator(slots, "slots")
    return HybridRadixCache(pa, sa, page_size=page_size, chunk_size=chunk, max_checkpoints_per_path=cap), pa, sa


def test_hit_stops_at_the_deepest_checkpoint_not_at_the_kv_match():
    cache, pa, sa = make()
    toks = list(range(100, 140))  # 40 tokens, 10 pages
    pages, slots = pa.alloc(10), sa.alloc(2)
    res = cache.insert(toks, pages, {8: slots[0], 24: slots[1]})
    assert res.duplicate_pages == [] and res.rejected_slots == []
    m = cache.match_prefix(toks[:30] + [7, 7, 7])
    assert (m.prefix_len, m.checkpoint_slot, m.kv_match_len) == (24, slots[1], 28)
    assert m.pages == pages[:6] and m.node.end == 24
    assert m.fork_pos is None  # the fork (chunk-aligned 24) already has a checkpoint
    cache.sanity_check(set(), set())


def test_leave_last_token_for_logits():
    cache, pa, sa = make()
    toks = list(range(16))
    s = sa.alloc(2)
    cache.insert(toks, pa.alloc(4), {8: s[0], 16: s[1]})
    assert cache.match_prefix(toks).prefix_len == 8
    assert cache.match_prefix(toks, leave_last=False).prefix_len == 16


def test_branch_point_is_planted_at_the_chunk_aligned_fork():
    cache, pa, sa = make()
    a = list(range(32))
    cache.insert(a, pa.alloc(8), {})  # KV only, no checkpoints yet
    b = a[:21] + [99] * 11  # diverges at 21 (page-aligned KV match 20, chunk-aligned fork 16)
    m = cache.match_prefix(b)
    assert (m.prefix_len, m.kv_match_len, m.fork_pos) == (0, 20, 16)
    # the request recomputes from 0, snapshots at 16 and inserts; its recomputed pages duplicate the tree's
    mine = pa.alloc(8)
    res = cache.insert(b, mine, {16: sa.alloc(1)[0]})
    assert res.duplicate_pages == mine[:5]  # positions [0, 20) were already cached
    pa.free(res.duplicate_pages)
    m2 = cache.match_prefix(a[:24] + [5] * 8)  # a third branch restores at the fork directly
    assert m2.prefix_len == 16 and m2.checkpoint_slot is not None
    cache.sanity_check(set(), set())


def test_second_checkpoint_at_same_position_is_rejected_and_stays_with_the_request():
    cache, pa, sa = make()
    toks = list(range(16))
    pages = pa.alloc(4)
    first, second = sa.alloc(2)
    cache.insert(toks, pages, {8: first})
    res = cache.insert(toks, pages, {8: second})
    assert res.rejected_slots == [second] and res.duplicate_pages == []
    sa.free(res.rejected_slots)
    cache.sanity_check(set(), set())


def test_per_path_cap_keeps_branch_points_longest():
    cache, pa, sa = make(cap=2)
    base, pages = list(range(40)), pa.alloc(10)
    fork_slot, s24, s32 = sa.alloc(3)
    cache.insert(base, pages, {8: fork_slot})
    other = base[:8] + [77] * 32  # diverges right at 8: the node ending at 8 becomes a branch point
    cache.insert(other, pages[:2] + pa.alloc(8))
    cache.insert(base, pages, {24: s24})
    cache.insert(base, pages, {32: s32})  # three on the path, cap 2: the older non-branch one (24) goes
    assert sa.is_free(s24) and not sa.is_free(fork_slot) and not sa.is_free(s32)
    assert cache.match_prefix(base[:33] + [3]).prefix_len == 32
    assert cache.match_prefix(base[:30] + [3]).checkpoint_slot == fork_slot
    cache.sanity_check()


def test_eviction_respects_locks_and_prefers_kv_without_checkpoints():
    cache, pa, sa = make(pages=12)
    a, b = [1] * 4 + list(range(20)), [2] * 4 + list(range(20))
    cache.insert(a, pa.alloc(6), {8: sa.alloc(1)[0]})
    cache.insert(b, pa.alloc(6), {})
    m = cache.match_prefix(a)
    cache.lock(m.node)
    assert cache.evict_pages(12) == 6 + 4  # b whole, and a's unlocked tail beyond the locked node
    assert cache.match_prefix(b).kv_match_len == 0
    assert cache.match_prefix(a).prefix_len == 8
    with pytest.raises(OutOfSlots):
        pa.alloc(11)
    cache.unlock(m.node)
    assert cache.evict_pages(100) == 2
    assert pa.num_free == 12 and sa.num_free == 16
    cache.sanity_check(set(), set())


def test_checkpoint_eviction_leaves_a_tombstone_with_its_kv():
    cache, pa, sa = make()
    toks = list(range(24))
    cache.insert(toks, pa.alloc(6), {8: sa.alloc(1)[0], 16: sa.alloc(1)[0]})
    assert cache.evict_checkpoints(1) == 1
    m = cache.match_prefix(toks)
    assert m.kv_match_len == 24 and m.prefix_len in (8, 16)
    assert cache.stats()["tombstones"] >= 1 and cache.stats()["pages"] == 6
    cache.sanity_check(set(), set())


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of page_size"):
        make(page_size=3, chunk=8)
    cache, pa, sa = make()
    with pytest.raises(ValueError, match="checkpoint at 12"):
        cache.insert(list(range(16)), pa.alloc(4), {12: 0})
    with pytest.raises(ValueError, match="cover 8 tokens"):
        cache.insert(list(range(5)), pa.alloc(2))


# ------------------------------------------------------------------------------------------------ fuzz
class Request:
    def __init__(self, tokens):
        self.tokens = tokens
        self.pages: list[int] = []  # page table for [0, len(pages) * page_size)
        self.private_pages: set[int] = set()
        self.slots: set[int] = set()  # working slot + snapshot buffer
        self.node = None
        self.pos = 0


def _alloc(cache, alloc, n, kind):
    """Allocate n ids, evicting from the cache under pressure; None when even that cannot make room."""
    if alloc.num_free < n:
        (cache.evict_pages if kind == "pages" else cache.evict_checkpoints)(n - alloc.num_free)
    return alloc.alloc(n) if alloc.num_free >= n else None


def _release(cache, pa, sa, req):
    if req.node is not None:
        cache.unlock(req.node)
    pa.free(sorted(req.private_pages))
    sa.free(sorted(req.slots))


def _shape(node):
    """A subtree as plain values (keys, pages, checkpoints, locks, LRU stamps), children in key order."""
    return (
        tuple(node.key),
        tuple(node.pages),
        node.end,
        node.checkpoint,
        node.lock_ref,
        node.last_access,
        tuple(_shape(node.children[k]) for k in sorted(node.children)),
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), page_size=st.sampled_from([1, 2, 4]), cap=st.integers(1, 4))
def test_fuzz_request_streams_keep_accounting_and_drain_to_full(seed, page_size, cap):
    """Random admits, chunks and aborts: accounting holds and the pools drain; each insert from the request's
    locked node (`start`) leaves the tree and returns what an insert walking from the root does."""
    rng = random.Random(seed)
    chunk = 4 * page_size
    cache, pa, sa = make(pages=48 // page_size * 2, slots=12, page_size=page_size, chunk=chunk, cap=cap)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
    running: list[Request] = []

    def check():
        pages = set().union(*(r.private_pages for r in running)) if running else set()
        slots = set().union(*(r.slots for r in running)) if running else set()
        cache.sanity_check(pages, slots)

    for _ in range(40):
        op = rng.random()
        if op < 0.4 or not running:  # admit
            toks = rng.choice(prefixes)[: rng.randrange(1, 40)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 20))
            ]
            req = Request(toks)
            m = cache.match_prefix(toks)
            cache.lock(m.node)
            req.node, req.pages, req.pos = m.node, list(m.pages), m.prefix_len
            working = _alloc(cache, sa, 1, "slots")
            if working is None:
                _release(cache, pa, sa, req)
                check()
                continue
            req.slots.add(working[0])
            running.append(req)
        elif op < 0.85:  # one prefill chunk of a running request
            req = rng.choice(running)
            end = min(len(req.tokens), (req.pos // chunk + 1) * chunk)
            need = -(-end // page_size) - len(req.pages)
            new = _alloc(cache, pa, need, "pages") if need > 0 else []
            snap = _alloc(cache, sa, 1, "slots") if end % chunk == 0 else []
            if new is None or snap is None:  # memory pressure: retract (the request would requeue)
                pa.free(new or [])
                sa.free(snap or [])
                running.remove(req)
                _release(cache, pa, sa, req)
                check()
                continue
            req.pages += new
            req.private_pages |= set(new)
            req.pos = end
            full = end // page_size
            donated = {end: snap[0]} if snap else {}
            twin, twin_pa, twin_sa = copy.deepcopy((cache, pa, sa))  # the same insert walking from the root
            res = cache.insert(req.tokens, req.pages[:full], donated, start=req.node)
            want = twin.insert(req.tokens, req.pages[:full], donated)
            assert (res.node.end, res.pages, res.duplicate_pages, res.rejected_slots) == (
                want.node.end,
                want.pages,
                want.duplicate_pages,
                want.rejected_slots,
            )
            assert _shape(cache.root) == _shape(twin.root)
            assert (pa.num_free, sa.num_free) == (twin_pa.num_free, twin_sa.num_free)
            req.private_pages -= set(req.pages[:full]) - set(res.duplicate_pages)
            req.pages[:full] = res.pages  # the tree's pages from here on, as the engine keeps them (start's premise)
            sa.free(res.rejected_slots)
            cache.lock(res.node)
            cache.unlock(req.node)
            req.node = res.node
            if req.pos >= len(req.tokens):  # finished
                running.remove(req)
                _release(cache, pa, sa, req)
        else:  # abort
            req = rng.choice(running)
            running.remove(req)
            _release(cache, pa, sa, req)
        check()
    for req in running:
        _release(cache, pa, sa, req)
    running.clear()
    check()
    cache.evict_pages(10**6)
    assert pa.num_free == pa.capacity and sa.num_free == sa.capacity
    assert cache.stats()["nodes"] == 0
