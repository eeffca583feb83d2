"""Paged MLA for the engine, in the absorbed form: attention runs in the latent space of the KV pages.

The reference `MLAMixer` expands the whole history through kv_b_proj every step (k_nope, v for every past
token: S x R x H(nope + v) work and memory per layer per step). With W_k, W_v the per-head blocks of
kv_b_proj's weight, q . k_nope = (W_k^T q_nope) . latent and o = W_v (sum_s p_s latent_s), so the engine
maps the queries into the latent space once, attends over the stored [latent | rope] rows directly
(a multi-query attention with one shared key/value head) and maps the result out once. Same function;
the work per step no longer grows with S times the expansion width.

A LoRA adapter on kv_b_proj (W + s B A per request) is absorbed the same way: the per-token low-rank
terms are added to the mapped queries and outputs, so adapters keep working on this path.

`absorbed_attention` is the engine's side of the shared layer's seam: `MLAMixer.forward` computes its
projections, output gate and o_proj itself and asks the cache for the attention over the history, which
`PoolStateCache.mla_attention` answers with this. A change to the layer's projections needs no mirror here.

Under tensor parallelism the mixer holds its heads (q, kv_b_proj's rows, o_proj's columns); under decode
context parallelism q and kv_b_proj hold every head of the rank's DCP group, the history is this rank's
positions only, and `rollout.dcp.dcp_attention` returns the merged latent outputs of the rank's own heads.
"""

from __future__ import annotations

import torch

from miles_k3.kernels import use_kernels
from miles_k3.model.layers import MLAMixer
from miles_k3.ops import exact
from rollout.dcp import dcp_attention
from rollout.kernels import mla_attention as kernel


def _dense_weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    base = getattr(linear, "base_weight", None)
    return base(dtype) if base is not None else linear.weight.to(dtype)


def _lora_terms(linear: torch.nn.Module, num_tokens: int):
    """(A [L, r, R], B [L, out, r], scale) of the adapter on kv_b_proj for the step's tokens, or None when no
    token has one. L = 1 and scale a float when one slot serves the whole batch (no per-token gather and no
    host-to-device copy, so decode graphs can capture it); else L = num_tokens and scale [L, 1, 1]."""
    pool = getattr(linear, "pool", None)
    if pool is None or pool.row_slots is None or linear.name not in pool.A:
        return None
    a, b = pool.A[linear.name], pool.B[linear.name]
    if (slot := pool.batch_slot) is not None:
        return None if slot == 0 else (a[slot][None], b[slot][None], float(pool.scale[slot]))
    slots = pool.token_slots()
    assert slots.numel() == num_tokens, f"adapter batch covers {slots.numel()} tokens, the step has {num_tokens}"
    slots = slots.to(a.device)
    return a[slots], b[slots], pool.device_scale[slots][:, None, None]


def absorbed_attention(
    mixer: MLAMixer, q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, cache
) -> torch.Tensor:
    """q [B, T, H, Dqk], this step's normed latent [B, T, R] and shared key part [B, T, Dr] -> attention
    output [B, T, H, Dv]. Writes the step's rows into the pages (`cache.mla_store`, a `PoolStateCache`) and
    attends over the history read back from them, per request of `cache.layout`: in one kernel
    (`rollout.kernels.mla_attention`) where the engine asks for it (`EngineConfig.mla_attention`) and
    `use_kernels` says yes (not under DCP), else gathered and attended in torch."""
    c = mixer.config
    b, t, hq = q.shape[:3]  # hq: the query heads, this rank's (TP) or its DCP group's
    h, nope, dv, r = mixer.heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    q = q.reshape(b * t, hq, c.qk_head_dim)  # tokens in input order
    buf = cache.mla_store(mixer.layer_idx, latent, rope)  # [rows, R + Dr]

    w = _dense_weight(mixer.kv_b_proj, q.dtype).view(hq, nope + dv, r)
    own = slice(None) if hq == h else slice(mixer.tp.dcp_rank * h, (mixer.tp.dcp_rank + 1) * h)
    w_k, w_v = w[:, :nope], w[own, nope:]
    q_nope, q_rope = q.split([nope, c.qk_rope_head_dim], dim=-1)
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_k)
    lora = _lora_terms(mixer.kv_b_proj, b * t)
    if lora is not None:
        a, bb, s = lora
        bb = bb.unflatten(1, (hq, nope + dv))  # [L, H, nope + dv, rank]; L = 1 broadcasts over tokens
        low = torch.einsum("thd,thdk->thk", q_nope.to(a.dtype), bb[:, :, :nope])
        q_lat = q_lat + (torch.einsum("thk,tkr->thr", low, a).float() * s).to(q_lat.dtype)
        lora = (a, bb, s)

    lay = cache.layout
    if hq != h:  # DCP: the group's heads over this rank's positions, merged into this rank's heads
        o_lat = dcp_attention(*_gathered(q_lat, q_rope, buf, lay), lay, mixer.scale, r, mixer.tp).to(q.dtype)
    elif cache.kv.attention == "triton" and use_kernels(q) and kernel.supports(q_lat, q_rope, buf, lay.hist_rows, r):
        o_lat = paged_attention(q_lat, q_rope, buf, lay, mixer.scale, r)
    else:
        hidden = cache.hidden_keys(lay.hist_rows.shape[1])
        o_lat = gathered_attention(q_lat, q_rope, buf, lay, mixer.scale, r, hidden)
    return _output(o_lat, w_v, lora, own, nope).reshape(b, t, h, dv)


def expanded_attention(
    mixer: MLAMixer, q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, cache
) -> torch.Tensor:
    """Exact mode's engine attention (`miles_k3.ops.exact`): `absorbed_attention`'s contract, computed as the
    trainer computes it: each request's history read back from the pages, expanded through kv_b_proj (the
    request's own adapter) into per-head keys and values, and attended by `exact.attention` with each query
    seeing the keys up to its own position. A history row's keys are the trainer's bits for that token, as
    every product is row-invariant there."""
    c = mixer.config
    b, t = q.shape[:2]
    h, nope, r = mixer.heads, c.qk_nope_head_dim, c.kv_lora_rank
    buf = cache.mla_store(mixer.layer_idx, latent, rope)
    lay = cache.layout
    n, tq = lay.q_index.shape
    hist = buf[lay.hist_rows].to(q.dtype)  # [N, S, R + Dr]: the zero page past a request's end
    pool = getattr(mixer.kv_b_proj, "pool", None)
    saved = None if pool is None or pool.row_slots is None else (pool.row_slots.tolist(), pool.tokens_per_row)
    if saved is not None:  # kv_b_proj over S history rows of each batch row, under that row's adapter
        pool.set_batch(saved[0], hist.shape[1])
    try:
        k_nope, v = mixer.kv_b_proj(hist[..., :r]).unflatten(-1, (h, -1)).split([nope, c.v_head_dim], dim=-1)
    finally:
        if saved is not None:
            pool.set_batch(*saved)
    rope_k = hist[..., None, r:].expand(*hist.shape[:2], h, c.qk_rope_head_dim)
    k = torch.cat([k_nope, rope_k], dim=-1)
    queries = q.reshape(b * t, h, c.qk_head_dim)
    out = queries.new_zeros(b * t, h, c.v_head_dim, dtype=v.dtype)
    valid = torch.zeros(n * tq, dtype=torch.bool, device=q.device)
    valid[lay.out_index] = True
    valid = valid.view(n, tq).cpu()
    for i in range(n):
        tokens = lay.q_index[i][valid[i]]
        visible = lay.q_pos[i][valid[i]].cpu() + 1
        out[tokens] = exact.attention(queries[tokens], k[i], v[i], mixer.scale, visible)
    return out.view(b, t, h, c.v_head_dim)


def gathered_attention(
    q_lat: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor, lay, scale: float, r: int, hidden: torch.Tensor
) -> torch.Tensor:
    """The torch path: the mapped queries q_lat [T, H, R], q_rope [T, H, Dr] (input order) over the histories
    gathered out of the page buffer `buf` [rows, R + Dr] by `lay` (a `BatchLayout`), `hidden` [N, 1, Tq, S]
    the positions each query may not see -> o_lat [T, H, R] in input order, in q_lat's dtype. Scores and
    softmax in fp32, as the reference's fused attention keeps them."""
    n, tq = lay.q_index.shape
    qf, hist32 = _gathered(q_lat, q_rope, buf, lay)
    scores = torch.einsum("nthe,nse->nhts", qf, hist32) * scale
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    o_lat = torch.einsum("nhts,nsr->nthr", probs, hist32[..., :r]).to(q_lat.dtype)
    return o_lat.reshape(n * tq, -1, r)[lay.out_index]


def _gathered(q_lat, q_rope, buf, lay) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded queries [N, Tq, H, R + Dr] and the histories gathered out of the pages [N, S, R + Dr] (in
    q's dtype, as stored), both in fp32."""
    qf = torch.cat([q_lat, q_rope], dim=-1)[lay.q_index].float()
    return qf, buf[lay.hist_rows].to(q_lat.dtype).float()


def paged_attention(
    q_lat: torch.Tensor, q_rope: torch.Tensor, buf: torch.Tensor, lay, scale: float, r: int
) -> torch.Tensor:
    """`gathered_attention` in one kernel reading the pages in place (`rollout.kernels.mla_attention`)."""
    n, tq = lay.q_index.shape
    o_lat = kernel.paged_mla_attention(q_lat, q_rope, buf, lay.hist_rows, lay.q_pos, lay.q_index, scale, r)
    o_lat = o_lat.reshape(n * tq, -1, r)
    return o_lat if tq == 1 and n == q_lat.shape[0] else o_lat[lay.out_index]  # decode: already in input order


def _output(o_lat: torch.Tensor, w_v: torch.Tensor, lora, own: slice, nope: int) -> torch.Tensor:
    """Latent outputs [T, H, R] of this rank's heads -> per-head values [T, H, Dv] through W_v (and the
    adapter's value rows of those heads: lora's B unflattened to [L, heads, nope + dv, rank])."""
    o = torch.einsum("thr,hdr->thd", o_lat, w_v)
    if lora is not None:
        a, bb, s = lora
        low = torch.einsum("thr,tkr->thk", o_lat.to(a.dtype), a)
        o = o + (torch.einsum("thk,thdk->thd", low, bb[:, own, nope:]).float() * s).to(o.dtype)
    return o
