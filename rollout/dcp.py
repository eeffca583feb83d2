"""Decode context parallelism (DCP): MLA's latent KV sharded by token position over a DCP group, and the
attention over it.

Why: MLA has one latent KV head, which tensor parallelism cannot split, so at TP = N every rank would hold a
full copy of every request's KV. Under DCP (`EngineConfig.dcp_size` = n, n consecutive TP ranks per group,
`rollout.parallel.EngineTP`) rank r of a group keeps only the positions p with p % n == r: a KV page of
`page_size` tokens holds `page_size / n` rows on each rank (`KVPagePool.rows_per_page`), position p of page
table `pages` at row pages[p // page_size] * rows_per_page + (p % page_size) // n. Page ids and tables are
the same on every rank, so the cache manager's accounting does not change; a rank's memory budget holds n
times the tokens.

Attention (one all-to-all per MLA layer):
1. each rank projects the queries of every head of its DCP group (the MLA query and kv_b projections hold
   the group's rows, `rollout.model_runner.EngineFactory`) and maps them into the latent space;
2. it attends them over its own positions: partial outputs o_r and per-head log-sum-exp lse_r
   (`partial_attention`);
3. one all-to-all inside the group sends each head's partials to the TP rank that owns the head
   (`exchange`), packed with the lse as one [tokens, heads, R + 1] tensor;
4. the owner merges exactly: o = sum_r exp(lse_r - lse) o_r with lse = logsumexp_r lse_r (`merge_partials`),
   which is softmax attention over the union of the positions.
KDA layers are untouched by DCP: they stay TP-sharded by head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# ------------------------------------------------------------------ the row mapping
def local_positions(s: int, size: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of history slots 0..ceil(s / size) - 1 on DCP rank `rank`: j * size + rank (the last ones may
    lie past `s`; callers mask them). Made on `device` (no host copy: a CUDA graph can capture it)."""
    return torch.arange(-(-s // size), device=device) * size + rank


def kv_rows(table: torch.Tensor, pos: torch.Tensor, page_size: int, size: int) -> torch.Tensor:
    """KV row on its owning rank of each position `pos` [N, K] of request n (page table rows `table` [N, P])."""
    page = table.gather(1, (pos // page_size).clamp(max=table.shape[1] - 1))
    return page * (page_size // size) + (pos % page_size) // size


def history_rows(
    table: torch.Tensor, ends: torch.Tensor, s: int, page_size: int, size: int, rank: int, zero_page: int
) -> torch.Tensor:
    """[N, ceil(s / size)]: this rank's KV row of each of its history positions, the zero page's first row
    for positions at or past a request's end."""
    pos = local_positions(s, size, rank, table.device)[None, :].expand(table.shape[0], -1)
    rows = kv_rows(table, pos, page_size, size)
    return torch.where(pos < ends[:, None], rows, zero_page * (page_size // size))


def write_rows(
    table: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    page_size: int,
    size: int,
    rank: int,
    sink_page: int,
) -> torch.Tensor:
    """KV row of each new token (input order) on this rank: its own row when it owns the position, else the
    sink page's first row (the write lands nowhere that is read)."""
    rows = kv_rows(table, q_pos, page_size, size)
    rows = torch.where(q_pos % size == rank, rows, sink_page * (page_size // size))
    return rows[q_valid]


# ------------------------------------------------------------------ attention
def partial_attention(
    q: torch.Tensor, hist: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor, scale: float, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [N, Tq, H, E] over this rank's keys hist [N, S, E] (values: their first
    `value_dim` entries) at positions key_pos [S], causal by q_pos [N, Tq] -> (o [N, Tq, H, value_dim],
    lse [N, Tq, H]) in q's dtype. A query that sees no key here gets o = 0 and lse = -inf."""
    scores = torch.einsum("nthe,nse->nhts", q, hist) * scale
    visible = key_pos[None, None, None, :] <= q_pos[:, None, :, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(scores - top)
    total = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("nhts,nsr->nthr", p / total.clamp_min(torch.finfo(p.dtype).tiny), hist[..., :value_dim])
    lse = (top + total.log()).squeeze(-1).transpose(1, 2)  # [N, Tq, H]; log(0) = -inf for no visible key
    return o, lse


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact merge of n partial attentions over disjoint key sets: o [n, T, H, R], lse [n, T, H] -> [T, H, R]
    (every query must see at least one key in some part)."""
    top = lse.amax(dim=0, keepdim=True)
    w = torch.exp(lse - top)  # -inf parts weigh 0
    return (w[..., None] * o).sum(0) / w.sum(0)[..., None]


def exchange(o: torch.Tensor, lse: torch.Tensor, size: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-to-all of a DCP group: this rank's partials for all the group's heads, o [T, size * H, R] and
    lse [T, size * H] (head block j owned by DCP rank j) -> every rank's partials for this rank's H heads,
    o [size, T, H, R] and lse [size, T, H] (in DCP rank order)."""
    t, hg, r = o.shape
    packed = torch.cat([o, lse[..., None].to(o.dtype)], dim=-1).view(t, size, hg // size, r + 1)
    send = packed.transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv[..., :r], recv[..., r]


def dcp_attention(q: torch.Tensor, hist: torch.Tensor, layout, scale: float, value_dim: int, tp) -> torch.Tensor:
    """The absorbed attention's DCP form: q [N, Tq, Hg, E] for the group's heads over this rank's positions,
    exchanged and merged -> this rank's heads' latent outputs [tokens, H, value_dim] in input order (fp32)."""
    key_pos = local_positions(hist.shape[1] * tp.dcp_size, tp.dcp_size, tp.dcp_rank, q.device)
    o, lse = partial_attention(q, hist, layout.q_pos, key_pos, scale, value_dim)
    n, tq, hg, r = o.shape
    o = o.reshape(n * tq, hg, r)[layout.out_index]
    lse = lse.reshape(n * tq, hg)[layout.out_index]
    o_parts, lse_parts = exchange(o, lse, tp.dcp_size, tp.dcp_group)
    return merge_partials(o_parts, lse_parts)
