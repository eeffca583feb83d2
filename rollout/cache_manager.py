"""Per-request memory: KV pages and KDA state slots, and every handover between a request and the radix cache.

The `CacheManager` owns the pools (`rollout.memory`) and one `HybridRadixCache` per adapter (KV and KDA
state depend on the adapter), and is the only code that moves a page or slot id between the free lists, a
running request and a tree. A request's life, as the scheduler and decode pipeline call it:

1. `match` then `admit`: the longest usable prefix is locked, a working slot is allocated (evicting
   checkpoints if needed) and the checkpoint restored into it, copy-on-write, before anything else can be
   allocated (stream order makes the copy read the checkpoint before any later write to that slot).
2. `grow` / `grow_all` before a forward: pages for the positions it writes, evicting unlocked tree leaves;
   on failure the scheduler retracts a request and asks again.
3. `donate` after a prefill chunk, `snapshots` + `donate_at` around a decode step: the page-aligned computed
   prefix goes to the tree (by index, no copy) and, at a chunk boundary, a copy of the working state.
4. `release`: a final KV insert, unlock, and the request's private pages and working slot back to the pools
   (finish, abort and retraction alike).

Between batches only (no request admitted): `release_pools` / `resume_pools` (colocation) and `drop_tree`
(an adapter's weights changed, so its cached prefixes are stale).

Unified memory (`EngineConfig.unified_memory`): both pools live in one `UnifiedArena`
(`rollout.unified_memory`), so a kind that runs short evicts the other kind too (same kind first: tree
leaves for pages, checkpoints for slots; then the other), and a free can move blocks. The manager renames
every holder it knows when the arena moves a block (`_renamed`: the trees and the admitted requests, which
it tracks from `admit` to `release`); a snapshot slot handed out by `snapshots` is pinned until it comes
back through `donate_at` or `free_snapshot` (the decode pipeline holds it in between, where nothing can
rename it). `snapshots` and `free_snapshot` never move a block (the arena defers their compactions to the
next other call), since a decode strategy calls them in the middle of its step, holding its rows' slot ids
and page tables as it gathered them. A `MatchResult` is a host copy of ids: `admit` matches again when its own
allocations freed or
moved anything. Admission takes the working slot and the pages of the rest of the prompt together, so a
request that cannot prefill waits instead of taking bytes the running requests' pages need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from miles_k3.model.config import K3Config
from rollout.config import EngineConfig
from rollout.memory import IndexAllocator, KDAStatePool, KVPagePool, PoolSizes
from rollout.radix_cache import HybridRadixCache, InsertResult, MatchResult, Node
from rollout.request import Request
from rollout.unified_memory import RegionAllocator, UnifiedArena


@dataclass(eq=False)
class Running:
    """An admitted request and what it holds. KV and state are computed for tokens[:pos]."""

    req: Request
    cache: HybridRadixCache  # the prefix tree of this request's adapter
    tokens: list[int]  # prompt + outputs fed so far or pending
    slot: int  # working KDA state slot
    node: Node  # locked in the radix cache
    pos: int
    pages: list[int]
    tree_pages: int = 0  # pages[:tree_pages] belong to the radix tree (locked); the rest are the request's
    fork_pos: int | None = None  # chunk-aligned branch point where a prefill chunk must end (Marconi)

    @property
    def private(self) -> list[int]:
        return self.pages[self.tree_pages :]

    @property
    def prefilling(self) -> bool:
        """More than the next input token is still to be computed."""
        return len(self.tokens) - self.pos > 1

    @property
    def keys(self) -> list[int]:
        """`tokens` as the prefix tree keys them (the ids, media pads as their images' keys: `rollout.media`)."""
        return self.req.cache_keys(self.tokens)


class CacheManager:
    def __init__(
        self, model_config: K3Config, config: EngineConfig, dtype: torch.dtype, device: torch.device, tp_size: int = 1
    ):
        """`tp_size`: the engine's tensor-parallel ranks (each rank's pools hold its share, `PoolSizes`)."""
        self.model_config, self.config, self.dtype, self.device = model_config, config, dtype, device
        shares = dict(page_size=config.page_size, dtype=dtype, tp_size=tp_size, dcp_size=config.dcp_size)
        if config.unified_memory:  # `state_fraction` does not apply: the arena has no fixed split
            self.sizes = PoolSizes.unified(model_config, config.memory_bytes, **shares)
        else:
            self.sizes = PoolSizes.from_budget(
                model_config, config.memory_bytes, state_fraction=config.state_fraction, **shares
            )
        self.arena: UnifiedArena | None = None
        self.kv: KVPagePool | None = None
        self.states: KDAStatePool | None = None
        self.caches: dict[str | None, HybridRadixCache] = {}
        self.admitted: dict[Running, None] = {}  # from admit to release (insertion-ordered set)
        self.resume_pools()

    # ----------------------------------------------------------- pools
    def release_pools(self) -> None:
        """Drop the pools and every tree, so a colocated trainer can use the memory."""
        self.kv = self.states = self.arena = None
        self.caches = {}
        self.admitted = {}

    def resident_bytes(self) -> int:
        """Bytes the pools take now: their sizes (`PoolSizes`; the arena's budget with unified memory) while
        allocated, 0 while released."""
        if self.kv is None:
            return 0
        if self.arena is not None:
            return self.config.memory_bytes
        s = self.sizes
        return s.num_pages * s.page_bytes + s.num_slots * s.slot_bytes

    def resume_pools(self) -> None:
        if self.kv is None:
            if self.config.unified_memory:
                self.arena = UnifiedArena(
                    self.config.memory_bytes,
                    self.sizes.slot_bytes,
                    self.sizes.page_bytes,
                    self.device,
                    on_move=self._renamed,
                )
            self.kv = KVPagePool(self.model_config, self.sizes, self.dtype, self.device, self.arena)
            self.states = KDAStatePool(self.model_config, self.sizes, self.dtype, self.device, self.arena)

    def cache_for(self, adapter: str | None) -> HybridRadixCache:
        if adapter not in self.caches:
            c = self.config
            self.caches[adapter] = HybridRadixCache(
                self.kv.allocator,
                self.states.allocator,
                page_size=c.page_size,
                chunk_size=c.chunk_size,
                max_checkpoints_per_path=c.max_checkpoints_per_path,
            )
        return self.caches[adapter]

    def drop_tree(self, adapter: str) -> None:
        """Forget `adapter`'s cached prefixes (no request using it may be running)."""
        stale = self.caches.get(adapter)
        if stale is not None:  # evicted while still listed: its frees may move its own other blocks
            stale.evict_pages(10**18)
            stale.evict_checkpoints(10**18)
            del self.caches[adapter]

    # ------------------------------------------------------- admission
    def match(self, adapter: str | None, tokens: list[int]) -> MatchResult:
        """The longest usable cached prefix of `tokens`, the tree's keys (`Request.cache_keys`: the ids of a
        request without media). Touches it for LRU; allocates nothing."""
        return self.cache_for(adapter).match_prefix(tokens)

    def admit(self, req: Request, tokens: list[int], m: MatchResult) -> Running | None:
        """`tokens`: the request's ids (prompt and outputs so far); `m`: the match of their cache keys.
        Lock `m`'s prefix, give the request a working slot restored from `m`'s checkpoint (zeroed on a
        miss) and its pages. None when no slot can be freed: nothing is held then.

        Unified memory: the slot and the pages of the rest of the prompt are taken together (`_reserve`),
        since the two kinds share the bytes: a request is admitted only when it can prefill without
        pushing running requests out."""
        self._settle()
        cache = self.cache_for(req.adapter)
        cache.lock(m.node)
        reserved: list[int] = []
        if self.arena is None:
            slot = self._alloc(self.states.allocator, 1, self.evict_checkpoints)
        else:
            version = self.arena.version
            slot, reserved = self._reserve(m, len(tokens)) or (None, [])
        if slot is None:
            cache.unlock(m.node)
            return None
        if self.arena is not None and self.arena.version != version:
            # blocks were freed or moved since the match, so m's ids may be stale: match again (the lock kept
            # m's pages, nothing was inserted: the new hit is m's, renamed, or shallower)
            fresh = cache.match_prefix(req.cache_keys(tokens))
            cache.lock(fresh.node)
            cache.unlock(m.node)
            m = fresh
        # copy-on-write restore, enqueued before anything can reuse the checkpoint's slot
        if m.checkpoint_slot is None:
            self.states.zero_slots(slot)
        else:
            self.states.copy_slots([m.checkpoint_slot], slot)
        req.cached_tokens = m.prefix_len
        r = Running(
            req,
            cache,
            tokens,
            slot[0],
            m.node,
            m.prefix_len,
            list(m.pages) + reserved,
            tree_pages=len(m.pages),
            fork_pos=m.fork_pos,
        )
        self.admitted[r] = None
        if self.arena is not None:  # r holds them now, and moves rename them there
            self.arena.slots.unpin(slot)
            self.arena.pages.unpin(reserved)
        return r

    def _reserve(self, m: MatchResult, num_tokens: int) -> tuple[list[int], list[int]] | None:
        """Unified memory: a working slot and the pages for positions [len(m.pages) * page_size, num_tokens),
        all or nothing. The checkpoint `m` restores is kept out of eviction's reach meanwhile, unless nothing
        else frees room; both come back pinned (nothing holds them yet that a move could rename)."""
        need = -(-num_tokens // self.config.page_size) - len(m.pages)
        node, keep = m.node, m.node.checkpoint
        if keep is not None:
            node.checkpoint = None  # out of eviction's reach; pinned, since no rename can reach it now
            self.arena.slots.pin([keep])
            got = self._take(need)
            node.checkpoint = keep
            self.arena.slots.unpin([keep])
            if got is not None:
                return got
        return self._take(need)

    def _take(self, num_pages: int) -> tuple[list[int], list[int]] | None:
        slot = self._alloc(self.states.allocator, 1, self.evict_checkpoints)
        if slot is None:
            return None
        self.arena.slots.pin(slot)
        pages = self._alloc(self.kv.allocator, num_pages, self.evict_pages) if num_pages > 0 else []
        if pages is None:
            self.states.allocator.free(slot)  # ends its pin
            return None
        self.arena.pages.pin(pages)
        return slot, pages

    # ----------------------------------------------------------- pages
    def _pages_short(self, r: Running, end: int) -> int:
        return -(-end // self.config.page_size) - len(r.pages)

    def grow(self, r: Running, end: int) -> bool:
        """Cover positions [0, end) of r with pages, evicting the trees if needed; False (nothing taken)
        when even that does not free enough."""
        self._settle()
        need = self._pages_short(r, end)
        if need <= 0:
            return True
        new = self._alloc(self.kv.allocator, need, self.evict_pages)
        if new is None:
            return False
        r.pages += new
        return True

    def grow_all(self, rows: list[Running], ends: list[int]) -> bool:
        """`grow` for every row at once, all or nothing."""
        self._settle()
        needs = [max(0, self._pages_short(r, end)) for r, end in zip(rows, ends)]
        if not any(needs):
            return True
        new = self._alloc(self.kv.allocator, sum(needs), self.evict_pages)
        if new is None:
            return False
        for r, n in zip(rows, needs):
            r.pages += new[:n]
            new = new[n:]
        return True

    def _alloc(
        self, allocator: IndexAllocator | RegionAllocator, n: int, evict: Callable[[int], int]
    ) -> list[int] | None:
        if allocator.num_free < n:
            evict(n - allocator.num_free)
        if allocator.num_free < n and self.arena is not None and not self.arena.deferring:
            self._evict_other_kind(allocator, n)  # only compaction turns the other kind's frees into room
        return allocator.alloc(n) if allocator.num_free >= n else None

    def _evict_other_kind(self, allocator: RegionAllocator, n: int) -> None:
        """Unified memory: evict blocks of the other kind until `n` of `allocator`'s kind fit (or nothing
        more can be evicted). Each free compacts its region, so the free region between them grows."""
        arena = self.arena
        pages = allocator is arena.pages
        block, other = (arena.page_bytes, arena.slot_bytes) if pages else (arena.slot_bytes, arena.page_bytes)
        evict = self.evict_checkpoints if pages else self.evict_pages
        while allocator.num_free < n:
            short = (n - allocator.num_free) * block - arena.free_bytes % block  # bytes the free region lacks
            if not evict(-(-short // other)):
                return

    def evict_pages(self, n: int) -> int:
        """Free up to about `n` KV pages from the trees (unlocked leaves); returns how many were freed."""
        return self._evict_across_trees(n, HybridRadixCache.evict_pages)

    def evict_checkpoints(self, n: int) -> int:
        """Free up to `n` checkpoint slots from the trees; returns how many were freed."""
        return self._evict_across_trees(n, HybridRadixCache.evict_checkpoints)

    def _evict_across_trees(self, n: int, evict) -> int:
        freed = 0
        for cache in list(self.caches.values()):
            if freed >= n:
                break
            freed += evict(cache, n - freed)
        return freed

    # ------------------------------------------------------- handovers
    def donate(self, rows: list[Running]) -> None:
        """Give the tree each row's page-aligned computed prefix and, for a row at a chunk boundary, a
        snapshot of its working state (a copy into a fresh slot; the tree then owns that slot by index): the
        rows' copies in one gather per pool tensor (`snapshots`), since a packed prefill of many short prompts
        brings most of its rows to a boundary at once (2026-12-03, one H200: a copy call per row was 20k of a
        batch-256 rollout's launches)."""
        at = [r for r in rows if r.pos % self.config.chunk_size == 0]
        snaps = dict(zip(map(id, at), self.snapshots(at)))
        for r in rows:
            self.donate_at(r, r.pos, snaps.get(id(r)))

    def snapshots(self, rows: list[Running]) -> list[int | None]:
        """Copy each row's working state into a fresh slot (None for a row no slot can be freed for), the
        copies in one gather per pool tensor: a decode batch reaches its chunk boundaries together, and a copy
        call per row was a few launches per row at that step. Slots are taken for the rows in order, evicting
        the checkpoints the batch lacks in one pass over the trees (2026-12-04, one H200: a pass per row made a
        batch-512 decode's boundary steps 0.5-0.9 s). Moves no block."""
        alloc = self.states.allocator
        with self._no_moves():
            if alloc.num_free < len(rows):
                self.evict_checkpoints(len(rows) - alloc.num_free)
            got = alloc.alloc(min(len(rows), alloc.num_free))
        snaps: list[int | None] = [*got, *[None] * (len(rows) - len(got))]
        taken = [(r.slot, s) for r, s in zip(rows, snaps) if s is not None]
        self.states.copy_slots([src for src, _ in taken], [dst for _, dst in taken])
        if self.arena is not None and taken:  # held by the caller until donate_at / free_snapshot: no moves
            self.arena.slots.pin([dst for _, dst in taken])
        return snaps

    def donate_at(self, r: Running, pos: int, snap: int | None) -> None:
        """Insert r's computed prefix up to `pos` (<= r.pos; its tokens known) with the checkpoint `snap`
        taken at `pos`, and move r's lock to the node that ends there."""
        self._settle()
        res = self._insert(r, {} if snap is None else {pos: snap}, end=pos)
        self.states.allocator.free(res.rejected_slots)
        if self.arena is not None and snap is not None and self.arena.is_pinned("slots", snap):
            self.arena.slots.unpin([snap])  # the tree holds it now (a free, above, ended the pin otherwise)
        r.cache.lock(res.node)
        r.cache.unlock(r.node)
        r.node = res.node

    def free_snapshot(self, snap: int | None) -> None:
        """A snapshot whose request left before its tree insert (or a strategy's undo slot). Moves no block."""
        if snap is not None:
            with self._no_moves():
                self.states.allocator.free([snap])

    def release(self, r: Running) -> None:
        """r stops running (finished, aborted or retracted): its computed KV goes to the tree, its private
        pages and working slot back to the pools. Enqueued kernels still reading them run first."""
        self._settle()
        self._insert(r, {})
        r.cache.unlock(r.node)
        self.kv.allocator.free(r.private)
        self.states.allocator.free([r.slot])
        self.admitted.pop(r, None)

    def _insert(self, r: Running, checkpoints: dict[int, int], end: int | None = None) -> InsertResult:
        """Hand the page-aligned computed prefix to the tree. The request switches to the tree's pages and
        its duplicates (KV it recomputed for positions the tree had) are freed at once, so a request never
        holds two copies of a prefix: its footprint stays what `submit` checked against the pool. The
        freed pages are only rewritten by later kernels on the same stream."""
        full = (r.pos if end is None else end) // self.config.page_size
        res = r.cache.insert(r.keys, r.pages[:full], checkpoints, start=r.node)  # r.node: its last insert's end
        r.pages[:full] = res.pages
        self.kv.allocator.free(res.duplicate_pages)
        r.tree_pages = full
        return res

    # ----------------------------------------------------------- moves
    @contextmanager
    def _no_moves(self) -> Iterator[None]:
        """Unified memory: frees inside leave holes; the next other call compacts them (`_settle`)."""
        if self.arena is None:
            yield
            return
        outer, self.arena.deferring = self.arena.deferring, True
        try:
            yield
        finally:
            self.arena.deferring = outer

    def _settle(self) -> None:
        if self.arena is not None:
            self.arena.settle()

    def _renamed(self, kind: str, moves: dict[int, int]) -> None:
        """The arena moved blocks of `kind` ({old id: new id}): rename them in every tree and admitted request."""
        if kind == "pages":
            for cache in self.caches.values():
                cache.rename_pages(moves)
            for r in self.admitted:
                r.pages[:] = [moves.get(p, p) for p in r.pages]
        else:
            for cache in self.caches.values():
                cache.rename_slots(moves)
            for r in self.admitted:
                r.slot = moves.get(r.slot, r.slot)

    # ----------------------------------------------------------- check
    def check(self, running: list[Running], pending_slots: set[int]) -> None:
        """Rebuild the accounting: every page / slot is in exactly one place (a tree, a running request,
        a snapshot waiting for its tree insert, free). Unified memory: also the arena's layout, and the
        pinned slots are exactly the pending snapshots."""
        if self.arena is not None:
            self.arena.check()
            assert set(running) == set(self.admitted), "the running requests are not the admitted ones"
            assert self.arena.pinned("slots") == pending_slots, (
                f"pinned slots {self.arena.pinned('slots')} != pending snapshots {pending_slots}"
            )
            assert not self.arena.pinned("pages"), "pages pinned between steps"
        pages = {p for r in running for p in r.private}
        slots = {r.slot for r in running} | pending_slots
        for name, cache in self.caches.items():
            others = [c for n, c in self.caches.items() if n != name]
            cache.sanity_check(
                pages.union(*(c.owned_pages() for c in others)), slots.union(*(c.owned_slots() for c in others))
            )
