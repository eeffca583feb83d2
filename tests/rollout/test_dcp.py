"""Decode context parallelism's pieces: the exact LSE merge of per-rank partial attentions equals full
attention (fp64), the row mapping puts every position on exactly one rank, and what it buys: a rank's budget
holds dcp_size times the tokens of KV."""

import pytest
import torch

from miles_k3.model import K3Config
from rollout.dcp import history_rows, kv_rows, local_positions, merge_partials, partial_attention, write_rows
from rollout.memory import PoolSizes


def full_attention(q, hist, q_pos, scale, value_dim):
    scores = torch.einsum("nthe,nse->nhts", q, hist) * scale
    key_pos = torch.arange(hist.shape[1])
    scores = scores.masked_fill(key_pos[None, None, None, :] > q_pos[:, None, :, None], float("-inf"))
    return torch.einsum("nhts,nsr->nthr", scores.softmax(-1), hist[..., :value_dim])


@pytest.mark.parametrize("size", [2, 3, 4])
def test_lse_merge_of_position_shards_equals_full_attention(size):
    g = torch.Generator().manual_seed(size)
    n, tq, h, e, r, s = 3, 5, 4, 12, 8, 17
    q = torch.randn(n, tq, h, e, generator=g, dtype=torch.float64)
    hist = torch.randn(n, s, e, generator=g, dtype=torch.float64)
    q_pos = torch.randint(0, s, (n, tq), generator=g)
    q_pos[0, 0] = 0  # a query that sees one key: every other rank has none (lse = -inf)
    want = full_attention(q, hist, q_pos, 0.3, r)
    parts = []
    for rank in range(size):
        pos = local_positions(s, size, rank)
        local = hist[:, pos.clamp(max=s - 1)]  # positions past the end are masked by causality
        parts.append(partial_attention(q, local, q_pos, pos, 0.3, r))
    o = torch.stack([p[0] for p in parts]).flatten(1, 2)  # [size, N * Tq, H, R]
    lse = torch.stack([p[1] for p in parts]).flatten(1, 2)
    got = merge_partials(o, lse).view(n, tq, h, r)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # one rank's part alone is not the attention: the merge is what makes it exact
    assert (parts[0][0] - want).abs().max() > 1e-3


def test_positions_map_to_one_row_on_one_rank():
    page, size = 8, 4
    table = torch.tensor([[3, 0, 5], [1, 2, 4]])
    ends = torch.tensor([20, 9])
    seen = set()
    for rank in range(size):
        used = []
        rows = history_rows(table, ends, 24, page, size, rank, zero_page=7)
        pos = local_positions(24, size, rank)
        assert rows.shape == (2, 6)
        for n in range(2):
            for j, p in enumerate(pos.tolist()):
                if p < ends[n]:
                    row = int(rows[n, j])
                    # page table entry of p, then p's slot among the page's rows kept on this rank
                    assert row == int(table[n, p // page]) * (page // size) + (p % page) // size
                    seen.add((n, p))
                    used.append(row)
                else:
                    assert int(rows[n, j]) == 7 * (page // size)  # past the end: the zero page
        assert len(used) == len(set(used))  # the requests' pages are distinct: so are their rows on a rank
    assert seen == {(n, p) for n in range(2) for p in range(int(ends[n]))}


def test_new_tokens_write_on_their_owner_only():
    page, size = 4, 2
    table = torch.tensor([[6, 2]])
    q_pos = torch.tensor([[3, 4, 5]])
    valid = torch.ones_like(q_pos, dtype=torch.bool)
    for rank in range(size):
        rows = write_rows(table, q_pos, valid, page, size, rank, sink_page=9)
        own = kv_rows(table, q_pos, page, size)[0]
        for i, p in enumerate(q_pos[0].tolist()):
            assert int(rows[i]) == (int(own[i]) if p % size == rank else 9 * (page // size))


def test_logical_kv_capacity_per_rank_grows_with_dcp(capsys):
    """K3 at 16 GiB of KV per rank (bf16), TP = 8: tokens of KV a rank holds with DCP = 1, 2, 4, 8."""
    config = K3Config.from_preset("k3")
    budget, fraction = 32 << 30, 0.5  # half of 32 GiB to KV pages
    tokens = {}
    for dcp in (1, 2, 4, 8):
        sizes = PoolSizes.from_budget(
            config, budget, page_size=64, state_fraction=fraction, dtype=torch.bfloat16, tp_size=8, dcp_size=dcp
        )
        tokens[dcp] = sizes.num_pages * sizes.page_size
    with capsys.disabled():
        print("\nK3, TP=8, 16 GiB of MLA KV per rank (bf16, 64-token pages): tokens of KV per rank")
        for dcp, n in tokens.items():
            print(f"  DCP={dcp}: {n:>12,} tokens ({n / tokens[1]:.1f}x)")
    for dcp in (2, 4, 8):
        assert tokens[dcp] >= dcp * tokens[1] - dcp * 64  # n times the tokens, up to page rounding
