"""Unified memory: KDA state slots and MLA KV pages carved from one byte pool that grows from both ends.

`EngineConfig(unified_memory=True)`. Two pools split `memory_bytes` once, by `state_fraction`: a bet on the
traffic (many short requests want slots, few long ones want pages). The `UnifiedArena` removes the bet:

    bytes  [sink slot | slot 1, 2, ... ->      free region      <- ... page P-2, P-1 | sink page | zero page]

State slots grow up from the bottom, KV pages down from the top, and whatever lies between is free for
either kind. The sink slot, sink page and zero page sit outside both regions and never move.

Fixed addresses. The pools keep their per-layer tensors (`KVPagePool.buffers[layer]`,
`KDAStatePool.recurrent[layer]` / `conv[layer]`): they are views into the arena whose dim-0 stride is one
block (`slot_blocks` / `page_blocks`), so every kernel, `BatchLayout` and the CUDA decode graphs read them
by id exactly as they read the two pools. Ids map to bytes once and for all (slot s at s * slot_bytes,
page p at kv_base + p * page_bytes); which ids are live is what changes.

Compaction. Each region is kept dense: freeing a block in the middle moves the region's end block into
the gap (one gather + scatter of whole blocks on the current stream: a kernel, no host sync) and renames
its id, `on_move(kind, {old: new})`, which the owner (`rollout.cache_manager.CacheManager`) applies to
every holder: the radix trees' edges and checkpoints, running requests' page tables and working slots.
Stream order is the happens-before: a step already enqueued reads and writes the block at its old id before
the move copies it, and every step enqueued later uses the new id.

What is safe to call when (the rule for every id this arena hands out):
- An id stays valid for its holder until the next `free` of the same kind, which may rename it. Holders
  the owner renames (trees, running requests) need nothing. A host copy of an id taken before a free (a
  `MatchResult`'s pages and checkpoint slot) is stale after it: read it again from its owner.
- A holder the owner cannot rename (the decode pipeline's in-flight snapshot slots, waiting for their
  tree inserts: `DecodePipeline.pending_slots()`) `pin`s the id for as long as it holds it. A pinned block
  never moves; while one sits at its region's end the region cannot shrink past it, and the gaps below it
  stay behind as holes, which the next allocations of that kind fill first. `unpin` resumes compaction.
- Freeing a pinned id ends its pin (its holder gave it up, or handed it to a tree that then evicted it).
  The sink and zero blocks are never handed out.
- Device kernels already enqueued may keep reading any id: moves are enqueued behind them.
- While `deferring` is set, frees and unpins only leave holes (`pending`); `settle()` compacts them later.
  The owner sets it around calls made in the middle of a decode step, whose caller may hold ids it
  gathered before (`CacheManager.snapshot` / `free_snapshot`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.memory import BLOCK_ALIGN, OutOfSlots
from rollout.transfer import to_device


class _Region:
    """One end of the arena: blocks of `block_bytes` at ranks 0, 1, ... counted from the arena's edge.

    Rank k is id `first + step * k` (slots count up from 1, pages down from P - 1). Ranks [0, extent) are
    the region; `holes` are free ranks inside it (while a pinned block holds the end, or compaction waits)."""

    def __init__(self, name: str, block_bytes: int, first: int, step: int):
        self.name, self.block_bytes, self.first, self.step = name, block_bytes, first, step
        self.extent = 0
        self.holes: set[int] = set()
        self.pinned: set[int] = set()  # ids

    def id_of(self, rank: int) -> int:
        return self.first + self.step * rank

    def rank_of(self, index: int) -> int:
        return (index - self.first) * self.step

    def is_live(self, index: int) -> bool:
        k = self.rank_of(index)
        return 0 <= k < self.extent and k not in self.holes


class UnifiedArena:
    """One byte pool for `budget_bytes` of slots and pages (plus the three fixed blocks).

    `slot_blocks` [max_slots + 1, slot_bytes] and `page_blocks` [max_pages + 2, page_bytes] are uint8 views
    of it, indexed by id (slot 0 is the sink; pages max_pages and max_pages + 1 are the sink and the zero
    page); they overlap in the middle, where the free region lies. `slots` and `pages` are the allocators
    (`RegionAllocator`, `IndexAllocator`'s interface). `on_move(kind, {old: new})` ("slots" / "pages") is
    called after every move, once the copy is enqueued."""

    def __init__(
        self,
        budget_bytes: int,
        slot_bytes: int,
        page_bytes: int,
        device: torch.device | str,
        on_move: Callable[[str, dict[int, int]], None] | None = None,
    ):
        assert slot_bytes % BLOCK_ALIGN == 0, f"slot_bytes {slot_bytes} is not a multiple of {BLOCK_ALIGN}"
        budget = budget_bytes // BLOCK_ALIGN * BLOCK_ALIGN
        if budget < slot_bytes + page_bytes:
            raise ValueError(
                f"memory budget {budget_bytes} B holds no KDA state slot ({slot_bytes} B) next to a "
                f"KV page ({page_bytes} B); need at least one of each"
            )
        self.slot_bytes, self.page_bytes, self.budget = slot_bytes, page_bytes, budget
        self.max_slots = budget // slot_bytes  # slot ids 1..max_slots
        self.max_pages = budget // page_bytes  # page ids 0..max_pages-1
        self.bottom = slot_bytes  # the regions' bytes: [bottom, top)
        self.top = slot_bytes + budget
        self.kv_base = self.top - self.max_pages * page_bytes  # byte offset of page id 0
        self.bytes = torch.zeros(self.top + 2 * page_bytes, dtype=torch.uint8, device=device)
        self.slot_blocks = self.bytes[: (self.max_slots + 1) * slot_bytes].view(self.max_slots + 1, slot_bytes)
        self.page_blocks = self.bytes[self.kv_base :].view(self.max_pages + 2, page_bytes)
        self.sink_slot, self.sink_page, self.zero_page = 0, self.max_pages, self.max_pages + 1
        self._regions = {
            "slots": _Region("kda state slots", slot_bytes, 1, 1),
            "pages": _Region("kv pages", page_bytes, self.max_pages - 1, -1),
        }
        self.on_move = on_move
        self.deferring = False  # frees leave holes; compaction waits for settle()
        self.pending = {"slots": False, "pages": False}  # a kind with holes left by a deferred compaction
        self.moves = 0  # blocks moved so far
        self.version = 0  # bumped by every free and every move: host copies of ids taken before may be stale
        self.slots = RegionAllocator(self, "slots", "kda state slots")
        self.pages = RegionAllocator(self, "pages", "kv pages")

    # ------------------------------------------------------------ bytes
    @property
    def low_end(self) -> int:
        """First byte above the slot region."""
        return self.bottom + self._regions["slots"].extent * self.slot_bytes

    @property
    def high_start(self) -> int:
        """First byte of the page region."""
        return self.top - self._regions["pages"].extent * self.page_bytes

    @property
    def free_bytes(self) -> int:
        """The free region between the two (holes not counted)."""
        return self.high_start - self.low_end

    def num_free(self, kind: str) -> int:
        region = self._regions[kind]
        return len(region.holes) + self.free_bytes // region.block_bytes

    def num_live(self, kind: str) -> int:
        region = self._regions[kind]
        return region.extent - len(region.holes)

    def is_free(self, kind: str, index: int) -> bool:
        return not self._regions[kind].is_live(index)

    def blocks(self, kind: str) -> torch.Tensor:
        return self.slot_blocks if kind == "slots" else self.page_blocks

    # ------------------------------------------------------- allocation
    def alloc(self, kind: str, n: int) -> list[int]:
        """n ids of `kind`, all or nothing (OutOfSlots): holes first, lowest rank first, then the free region."""
        region = self._regions[kind]
        if n > self.num_free(kind):
            raise OutOfSlots(
                f"{region.name}: asked for {n}, {self.num_free(kind)} free ({self.free_bytes} B between the regions)"
            )
        reuse = sorted(region.holes)[:n]
        region.holes.difference_update(reuse)
        ranks = reuse + list(range(region.extent, region.extent + n - len(reuse)))
        region.extent += n - len(reuse)
        return [region.id_of(k) for k in ranks]

    def free(self, kind: str, indices: list[int]) -> None:
        """Give ids back, then compact `kind`'s region (moves, `on_move`)."""
        region = self._regions[kind]
        for i in indices:
            assert region.is_live(i), f"{region.name}: double free of {i}"
            region.pinned.discard(i)
            region.holes.add(region.rank_of(i))
        if indices:
            self.version += 1
            self._compact_or_defer(kind)

    def pin(self, kind: str, indices: list[int]) -> None:
        """These ids are held where `on_move` cannot rename them: never move them until `unpin`."""
        region = self._regions[kind]
        for i in indices:
            assert region.is_live(i) and i not in region.pinned, f"{region.name}: pin of free or pinned {i}"
            region.pinned.add(i)

    def is_pinned(self, kind: str, index: int) -> bool:
        return index in self._regions[kind].pinned

    def pinned(self, kind: str) -> set[int]:
        return set(self._regions[kind].pinned)

    def unpin(self, kind: str, indices: list[int]) -> None:
        region = self._regions[kind]
        for i in indices:
            region.pinned.remove(i)
        if region.holes:
            self._compact_or_defer(kind)

    def settle(self) -> None:
        """Run the compactions `deferring` held back (nothing while it is still set)."""
        for kind, pending in self.pending.items():
            if pending and not self.deferring:
                self.pending[kind] = False
                self._compact(kind)

    def _compact_or_defer(self, kind: str) -> None:
        if self.deferring:
            self.pending[kind] = True
        else:
            self._compact(kind)

    def _compact(self, kind: str) -> None:
        """Shrink the region to its live blocks: drop free end blocks, move live ones into the lowest holes,
        until no hole is left or a pinned block holds the end."""
        region = self._regions[kind]
        moves: dict[int, int] = {}
        while region.extent:
            end = region.extent - 1
            if end in region.holes:
                region.holes.remove(end)
                region.extent -= 1
                continue
            src = region.id_of(end)
            if not region.holes or src in region.pinned:
                break
            dst = min(region.holes)
            region.holes.remove(dst)
            region.extent -= 1
            moves[src] = region.id_of(dst)
        if moves:
            # the lowest hole lies below every later end, so no destination is moved again: one copy serves
            assert not set(moves.values()) & set(moves), "a block was moved twice"
            blocks = self.blocks(kind)
            device = blocks.device
            src = to_device(list(moves), device, torch.long)
            dst = to_device(list(moves.values()), device, torch.long)
            blocks.index_copy_(0, dst, blocks.index_select(0, src))
            self.moves += len(moves)
            self.version += 1
            if self.on_move is not None:
                self.on_move(kind, moves)

    # ------------------------------------------------------------ check
    def check(self) -> None:
        """The layout's invariants: regions within bounds and apart, one free region between them, holes only
        behind a pinned end block, pins on live blocks."""
        assert self.bottom <= self.low_end <= self.high_start <= self.top, "the regions overlap"
        for kind, region in self._regions.items():
            assert all(0 <= k < region.extent for k in region.holes)
            assert all(region.is_live(i) for i in region.pinned), f"{region.name}: a pinned block is free"
            if region.holes and not self.pending[kind]:
                assert region.id_of(region.extent - 1) in region.pinned, (
                    f"{region.name}: holes {sorted(region.holes)} behind an unpinned end block"
                )


class RegionAllocator:
    """`IndexAllocator`'s interface over one region of a `UnifiedArena`, so pools and radix trees take
    either. `capacity` is what this kind could hold now (live + free): the other kind's blocks take the rest
    of the arena, so it changes as they come and go. Ids can be renamed by a free (the arena's docstring)."""

    def __init__(self, arena: UnifiedArena, kind: str, name: str):
        self.arena, self.kind, self.name = arena, kind, name

    @property
    def num_free(self) -> int:
        return self.arena.num_free(self.kind)

    @property
    def num_live(self) -> int:
        return self.arena.num_live(self.kind)

    @property
    def capacity(self) -> int:
        return self.num_live + self.num_free

    def alloc(self, n: int) -> list[int]:
        return self.arena.alloc(self.kind, n)

    def free(self, indices: list[int]) -> None:
        self.arena.free(self.kind, indices)

    def is_free(self, index: int) -> bool:
        return self.arena.is_free(self.kind, index)

    def pin(self, indices: list[int]) -> None:
        self.arena.pin(self.kind, indices)

    def unpin(self, indices: list[int]) -> None:
        self.arena.unpin(self.kind, indices)
