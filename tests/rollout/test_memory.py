"""Engine pools: allocators, sizing from a memory budget, slot copies, page-table row mapping."""

import pytest
import torch

from miles_k3.model import K3Config
from rollout.memory import IndexAllocator, KDAStatePool, KVPagePool, OutOfSlots, PoolSizes


def test_allocator_is_all_or_nothing_and_catches_double_free():
    a = IndexAllocator(4, "x")
    got = a.alloc(3)
    assert got == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfSlots, match="asked for 2, 1 free"):
        a.alloc(2)
    assert a.num_free == 1
    a.free([1])
    with pytest.raises(AssertionError, match="double free"):
        a.free([1])


def test_pool_sizes_follow_the_budget():
    c = K3Config.from_preset("k3-tiny")
    page = PoolSizes.bytes_per_page(c, 16, torch.bfloat16)
    slot = PoolSizes.bytes_per_slot(c, torch.bfloat16)
    assert page == 2 * 16 * (32 + 16) * 2  # 2 MLA layers, latent 32 + rope 16, bf16
    assert slot == 4 * (4 * 32 * 32 * 4 + 3 * 128 * 3 * 2)  # 4 KDA layers: fp32 state + bf16 conv history
    sizes = PoolSizes.from_budget(
        c, 10 * slot + 100 * page, page_size=16, state_fraction=10 * slot / (10 * slot + 100 * page)
    )
    assert (sizes.num_slots, sizes.num_pages) in {(10, 100), (9, 100), (10, 99)}
    with pytest.raises(ValueError, match="need at least one"):
        PoolSizes.from_budget(c, 100, page_size=16, state_fraction=0.5)
    with pytest.raises(ValueError, match="state_fraction"):
        PoolSizes.from_budget(c, 10**9, page_size=16, state_fraction=1.0)


def test_unified_sizes_count_each_kind_next_to_one_block_of_the_other():
    c = K3Config.from_preset("k3-tiny")
    page = PoolSizes.bytes_per_page(c, 16, torch.bfloat16)
    slot = PoolSizes.bytes_per_slot(c, torch.bfloat16)  # a multiple of 16 already: no padding
    sizes = PoolSizes.unified(c, 10 * slot + 100 * page, page_size=16)
    assert (sizes.slot_bytes, sizes.page_bytes) == (slot, page)
    assert sizes.num_slots == (10 * slot + 99 * page) // slot and sizes.num_pages == 9 * slot // page + 100
    half = PoolSizes.unified(c, 10 * slot + 100 * page, page_size=16, tp_size=2, dcp_size=2)
    assert (half.kda_heads, half.kv_rows_per_page) == (c.kda_num_heads // 2, 8) and half.page_bytes == page // 2
    with pytest.raises(ValueError, match="need at least one of each"):
        PoolSizes.unified(c, slot, page_size=16)


def test_state_slot_copy_and_zero():
    c = K3Config.from_preset("k3-tiny")
    pool = KDAStatePool(c, PoolSizes(1, 4, 1, 1, 1, c.kda_num_heads, 1), torch.float32, "cpu")
    layer = pool.kda_layers[0]
    pool.recurrent[layer][1].normal_()
    pool.conv[layer][1].normal_()
    pool.copy_slots([1], [3])
    assert torch.equal(pool.recurrent[layer][3], pool.recurrent[layer][1])
    assert torch.equal(pool.conv[layer][3], pool.conv[layer][1])
    pool.zero_slots([3])
    assert not pool.recurrent[layer][3].any() and pool.recurrent[layer][1].any()


def test_kv_rows_follow_the_page_table():
    c = K3Config.from_preset("k3-tiny")
    pool = KVPagePool(c, PoolSizes(8, 1, 4, 1, 1, c.kda_num_heads, 4), torch.float32, "cpu")
    rows = pool.rows([5, 2], 2, 7)
    assert rows.tolist() == [22, 23, 8, 9, 10]
    assert set(pool.buffers) == {i for i, k in enumerate(c.layer_kinds) if k == "mla"}
