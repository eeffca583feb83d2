"""Engine memory: index allocators, the paged MLA KV pool, the KDA state pool, sizing from a budget.

Two kinds of state (docs/design.md, "Engine invariants"): MLA KV is append-only and paged (one page holds
`page_size` tokens of every MLA layer's latent + shared key part); KDA state is one fixed-size slot per
request or cached checkpoint (every KDA layer's recurrent state and conv history), overwritten in place.

Indices are plain ints on the host; tensors live on the pool's device. Copies between slots are single
`index_copy_` launches on the current stream, so stream order is their happens-before: no sync, no lock.

By default each pool owns its tensors (`memory_bytes` split by `state_fraction`). Built over a
`rollout.unified_memory.UnifiedArena` (`EngineConfig.unified_memory`), both pools are views into one byte
pool and their allocators are its two regions: the same tensors by id, the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_k3.model.config import K3Config
from rollout.transfer import to_device

if TYPE_CHECKING:
    from rollout.unified_memory import UnifiedArena

BLOCK_ALIGN = 16  # bytes: a unified pool's slots are padded to this, so every typed view of a block is aligned


class OutOfSlots(RuntimeError):
    """An allocator could not satisfy a request; the caller evicts or retracts and tries again."""


class IndexAllocator:
    """A free list over [0, capacity). `alloc(n)` is all-or-nothing; double frees are invariant violations."""

    def __init__(self, capacity: int, name: str):
        if capacity <= 0:
            raise ValueError(f"{name}: capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.name = name
        # Low indices first: a reused slot is warm in cache and tests read naturally.
        self._free = list(range(capacity - 1, -1, -1))
        self._is_free = [True] * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlots(f"{self.name}: asked for {n}, {len(self._free)} free of {self.capacity}")
        out = [self._free.pop() for _ in range(n)]
        for i in out:
            self._is_free[i] = False
        return out

    def free(self, indices: list[int]) -> None:
        for i in indices:
            assert not self._is_free[i], f"{self.name}: double free of {i}"
            self._is_free[i] = True
            self._free.append(i)

    def is_free(self, index: int) -> bool:
        return self._is_free[index]


@dataclass(frozen=True)
class PoolSizes:
    """How many KV pages and KDA state slots fit a memory budget, and what one rank stores of each.

    A rank of a tensor-parallel engine (`tp_size` ranks) keeps its `kda_heads` = kda_num_heads / tp_size
    heads of every KDA slot; under decode context parallelism (`dcp_size` ranks) it keeps `kv_rows_per_page`
    = page_size / dcp_size rows of every KV page (the page's positions p with p % dcp_size == its DCP rank).
    Page and slot ids are the same on every rank: one page table serves all of them."""

    num_pages: int
    num_slots: int
    page_size: int
    page_bytes: int  # one rank's bytes per page
    slot_bytes: int  # one rank's bytes per slot
    kda_heads: int  # KDA heads one slot holds on this rank
    kv_rows_per_page: int  # KV rows one page holds on this rank

    @staticmethod
    def bytes_per_page(config: K3Config, page_size: int, dtype: torch.dtype, dcp_size: int = 1) -> int:
        mla_layers = config.layer_kinds.count("mla")
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return mla_layers * (page_size // dcp_size) * width * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def bytes_per_slot(config: K3Config, conv_dtype: torch.dtype, tp_size: int = 1) -> int:
        kda_layers = config.layer_kinds.count("kda")
        heads = config.kda_num_heads // tp_size
        recurrent = heads * config.kda_head_dim * config.kda_head_dim * 4  # fp32
        conv_channels = heads * config.kda_head_dim
        conv = 3 * conv_channels * (config.kda_conv_kernel - 1) * torch.empty((), dtype=conv_dtype).element_size()
        return kda_layers * (recurrent + conv)

    @classmethod
    def _block_bytes(
        cls, config: K3Config, page_size: int, dtype: torch.dtype, tp_size: int, dcp_size: int
    ) -> tuple[int, int]:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if config.kda_num_heads % tp_size:
            raise ValueError(
                f"K3Config.kda_num_heads={config.kda_num_heads} is not divisible by the tensor-parallel size {tp_size}"
            )
        if page_size % dcp_size:
            raise ValueError(f"page_size {page_size} is not divisible by dcp_size {dcp_size}")
        return cls.bytes_per_page(config, page_size, dtype, dcp_size), cls.bytes_per_slot(config, dtype, tp_size)

    @classmethod
    def from_budget(
        cls,
        config: K3Config,
        budget_bytes: int,
        *,
        page_size: int,
        state_fraction: float,
        dtype: torch.dtype = torch.bfloat16,
        tp_size: int = 1,
        dcp_size: int = 1,
    ) -> "PoolSizes":
        """Split one rank's `budget_bytes` between KDA slots (`state_fraction` of it) and KV pages (the rest)."""
        if not 0.0 < state_fraction < 1.0:
            raise ValueError(f"state_fraction must be in (0, 1), got {state_fraction}")
        page_bytes, slot_bytes = cls._block_bytes(config, page_size, dtype, tp_size, dcp_size)
        num_slots = int(budget_bytes * state_fraction) // max(slot_bytes, 1)
        num_pages = int(budget_bytes * (1 - state_fraction)) // max(page_bytes, 1)
        if num_slots < 1 or num_pages < 1:
            raise ValueError(
                f"memory budget {budget_bytes} B holds {num_slots} state slots ({slot_bytes} B each) "
                f"and {num_pages} KV pages ({page_bytes} B each); need at least one of each"
            )
        return cls(
            num_pages,
            num_slots,
            page_size,
            page_bytes,
            slot_bytes,
            config.kda_num_heads // tp_size,
            page_size // dcp_size,
        )

    @classmethod
    def unified(
        cls,
        config: K3Config,
        budget_bytes: int,
        *,
        page_size: int,
        dtype: torch.dtype = torch.bfloat16,
        tp_size: int = 1,
        dcp_size: int = 1,
    ) -> "PoolSizes":
        """One rank's `budget_bytes` as one byte pool for both kinds (`rollout.unified_memory`): slots are
        padded to `BLOCK_ALIGN` bytes, and `num_pages` / `num_slots` are the most of each kind that fit next
        to one block of the other (a request alone holds its working slot and its pages)."""
        page_bytes, slot_bytes = cls._block_bytes(config, page_size, dtype, tp_size, dcp_size)
        slot_bytes = -(-slot_bytes // BLOCK_ALIGN) * BLOCK_ALIGN
        budget = budget_bytes // BLOCK_ALIGN * BLOCK_ALIGN
        num_pages, num_slots = (budget - slot_bytes) // page_bytes, (budget - page_bytes) // slot_bytes
        if num_slots < 1 or num_pages < 1:
            raise ValueError(
                f"memory budget {budget_bytes} B holds no KDA state slot ({slot_bytes} B) next to a "
                f"KV page ({page_bytes} B); need at least one of each"
            )
        return cls(
            num_pages,
            num_slots,
            page_size,
            page_bytes,
            slot_bytes,
            config.kda_num_heads // tp_size,
            page_size // dcp_size,
        )


class KVPagePool:
    """MLA KV storage: per MLA layer a [num_pages * page_size, kv_lora_rank + rope_dim] buffer.

    Token position p of a request with page table `pages` lives at row pages[p // page_size] * page_size
    + p % page_size. Rows hold the *normed* latent and the shared key part, as the MLA layer hands them
    to the cache. Two extra pages past the allocator's range are never handed out: padding rows of a
    fixed-shape (CUDA-graph) batch write into `sink_page`; history positions past a request's end read
    from `zero_page`, which nothing writes (masked attention weights are 0, and 0 * garbage could be NaN).

    Over a `UnifiedArena` the buffers are views of its page blocks (a page's rows position-major, layer
    minor, so each layer's rows are one stride apart) and the allocator is the arena's page region.
    """

    def __init__(
        self,
        config: K3Config,
        sizes: PoolSizes,
        dtype: torch.dtype,
        device: torch.device | str,
        arena: UnifiedArena | None = None,
    ):
        self.page_size = sizes.page_size
        self.mla_layers = [i for i, k in enumerate(config.layer_kinds) if k == "mla"]
        # how steps attend over these pages (`EngineConfig.mla_attention`; `ModelRunner.use_pools` sets it)
        self.attention = "torch"
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.rows_per_page = sizes.kv_rows_per_page  # page_size, or page_size / dcp_size under DCP
        if arena is None:
            self.allocator = IndexAllocator(sizes.num_pages, "kv pages")
            self.sink_page, self.zero_page = sizes.num_pages, sizes.num_pages + 1
            self.buffers = {
                i: torch.zeros((sizes.num_pages + 2) * self.rows_per_page, width, dtype=dtype, device=device)
                for i in self.mla_layers
            }
            return
        assert arena.page_bytes == sizes.page_bytes
        self.allocator = arena.pages
        self.sink_page, self.zero_page = arena.sink_page, arena.zero_page
        rows = arena.page_blocks.view(dtype).view(arena.max_pages + 2, self.rows_per_page, len(self.mla_layers), width)
        self.buffers = {i: rows[:, :, j].view(-1, width) for j, i in enumerate(self.mla_layers)}

    def rows(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Row indices (on the pool's device) of token positions [start, end) for a page table (a pool that
        keeps whole pages: no DCP)."""
        assert self.rows_per_page == self.page_size, "under DCP a rank keeps only its positions' rows"
        pos = torch.arange(start, end)
        page_idx = torch.tensor(pages, dtype=torch.long)[pos // self.page_size]
        device = next(iter(self.buffers.values())).device if self.buffers else "cpu"
        return to_device(page_idx * self.page_size + pos % self.page_size, device)


class KDAStatePool:
    """KDA state slots: per KDA layer recurrent [num_slots, H, K, V] fp32 and conv [num_slots, 3, H*K, W-1]
    (H: this rank's heads, `PoolSizes.kda_heads`).

    Plus one `sink_slot` outside the allocator's range, the read/write target of padding rows.

    Over a `UnifiedArena` the tensors are views of its slot blocks (every layer's recurrent state, then every
    layer's conv history, in one block), the allocator is the arena's slot region, and a slot copy or zero
    is one launch over whole blocks."""

    def __init__(
        self,
        config: K3Config,
        sizes: PoolSizes,
        conv_dtype: torch.dtype,
        device: torch.device | str,
        arena: UnifiedArena | None = None,
    ):
        self.kda_layers = [i for i, k in enumerate(config.layer_kinds) if k == "kda"]
        h, d, w = sizes.kda_heads, config.kda_head_dim, config.kda_conv_kernel - 1  # h: this rank's heads
        if arena is None:
            self.allocator = IndexAllocator(sizes.num_slots, "kda state slots")
            self.sink_slot = sizes.num_slots
            n = sizes.num_slots + 1
            self.recurrent = {i: torch.zeros(n, h, d, d, dtype=torch.float32, device=device) for i in self.kda_layers}
            self.conv = {i: torch.zeros(n, 3, h * d, w, dtype=conv_dtype, device=device) for i in self.kda_layers}
            self._tensors = [*self.recurrent.values(), *self.conv.values()]
            return
        assert arena.slot_bytes == sizes.slot_bytes
        self.allocator = arena.slots
        self.sink_slot, n = arena.sink_slot, arena.max_slots + 1
        rec, conv = h * d * d, 3 * h * d * w  # elements per layer
        f32, cv = arena.slot_blocks.view(torch.float32), arena.slot_blocks.view(conv_dtype)
        conv_start = len(self.kda_layers) * rec * 4 // cv.element_size()
        self.recurrent = {i: f32[:, j * rec : (j + 1) * rec].view(n, h, d, d) for j, i in enumerate(self.kda_layers)}
        self.conv = {
            i: cv[:, conv_start + j * conv : conv_start + (j + 1) * conv].view(n, 3, h * d, w)
            for j, i in enumerate(self.kda_layers)
        }
        self._tensors = [arena.slot_blocks]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """dst[j] <- src[j] for every layer: one gather + index_copy_ per tensor on the current stream."""
        assert len(src) == len(dst)
        if not src:
            return
        device = self._tensors[0].device
        s, d = to_device(src, device, torch.long), to_device(dst, device, torch.long)
        for buf in self._tensors:
            buf.index_copy_(0, d, buf.index_select(0, s))

    def zero_slots(self, slots: list[int]) -> None:
        """A fresh request starts from zero history."""
        if not slots:
            return
        idx = to_device(slots, self._tensors[0].device, torch.long)
        for buf in self._tensors:
            buf.index_fill_(0, idx, 0)
