"""The engine's paged MLA attention (absorbed form, `rollout.attention`) as one Triton kernel, two when the
history is split across programs.

The torch path gathers every request's history out of the pages ([N, S, R + Dr]), upcasts it to fp32, and
materializes the scores, their mask and softmax, about ten kernels a layer and, at batch 256 with 1k-token
histories, over 2 GB of copies a layer a step, all growing with the history. Here each program reads its
request's history rows straight from the pages (row by row through `hist_rows`), once for all the heads
(MLA's absorbed form is multi-query: one latent key / value row per position serves every head), and folds
them into an online softmax in fp32 registers; it stops at its queries' last visible position, so a CUDA
graph's padded history costs nothing past each request's end.

Contract of `paged_mla_attention(q_lat, q_rope, kv, hist_rows, q_pos, q_index, scale, r, splits=None)`
(`supports` says which calls qualify; `rollout.attention` runs its torch path for the others):
- q_lat [Ttok, H, R] and q_rope [Ttok, H, Dr]: the step's queries mapped into the latent space, in input
  order, one dtype with kv (fp32 / bf16 / fp16), last dim contiguous, any other strides.
- kv [rows, R + Dr]: the layer's page buffer (each row a position's normed latent, then its shared rope
  key), last dim contiguous, any row stride (the unified arena's buffers interleave layers).
- hist_rows [N, S], q_pos [N, Tq], q_index [N, Tq]: integer tensors of the step's `BatchLayout`: query (n, t)
  is input token q_index[n, t] and sees history positions 0..q_pos[n, t], read from rows hist_rows[n, :].
- returns o_lat [N, Tq, H, R] in kv's dtype: softmax over the visible positions of (q . key) * scale,
  times the positions' latents. Padded queries get their own (discarded) rows; nothing else is written.
- math in fp32: scores from exact products (of bf16 / fp16 inputs, or fp32 ones in fp32) summed in fp32,
  softmax and weighted sum in fp32 (for 16-bit inputs on the device the probabilities times the latents in
  3xTF32, about fp32's precision: a bf16 latent is exact in TF32), rounded once to kv's dtype. The summation
  orders and the online rescaling differ from the torch path's, so the two agree to fp32 rounding, not bit
  for bit (tests/rollout/mla_cases.py holds the kernel to an fp64 reference: fp32 within 1e-5, bf16 within
  one ulp of the exact value).

Dots: on the device (`tensor_cores`, default on CUDA) 16-bit inputs run their scores on tensor cores in their
dtype and the weighted sum in 3xTF32; fp32 inputs, and everything in Triton's interpreter (whose 16-bit dots
multiply the raw bits), run fp32 dots (FMA loops: the first version ran those for bf16 too, and lost to the
torch path on the H200). The CPU tests pass `tensor_cores=True` only to record the device's variant for
the sm_90 compile check.

`splits` > 1 (default: enough to give the device about two programs per SM) splits each request's history
into that many ranges, one program each; a second kernel merges their partial outputs by their log-sum-exps.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl

    from miles_k3.kernels.rounding import DTYPES, round_to
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None

MAX_R = 1024  # a program holds [BM, R] fp32 of running output and a [BS, R] block of keys
_BM = 16  # query rows (token, head pairs) per program: tl.dot's smallest tile


if triton is not None:

    @triton.jit
    def _mla_attention(
        ql_ptr,
        qr_ptr,
        kv_ptr,
        rows_ptr,
        pos_ptr,
        qidx_ptr,
        out_ptr,
        part_ptr,
        lse_ptr,
        S,
        TQ,
        H,
        split_len,
        scale,
        sql_t,
        sql_h,
        sqr_t,
        sqr_h,
        s_kv,
        s_rows,
        s_pos,
        s_qidx,
        R: tl.constexpr,
        DR: tl.constexpr,
        BR: tl.constexpr,
        BDR: tl.constexpr,
        BM: tl.constexpr,
        BS: tl.constexpr,
        SPLIT: tl.constexpr,
        UPCAST: tl.constexpr,
        PREC: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(2)
        m = tl.program_id(1) * BM + tl.arange(0, BM)  # query rows: (token t, head h) = (m // H, m % H)
        m_ok = m < TQ * H
        t, h = m // H, m % H
        token = tl.load(qidx_ptr + n * s_qidx + t, mask=m_ok, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + n * s_pos + t, mask=m_ok, other=-1)  # rows past the last see nothing
        rr, dd = tl.arange(0, BR), tl.arange(0, BDR)
        r_ok, d_ok = rr < R, dd < DR
        ql = tl.load(
            ql_ptr + token[:, None] * sql_t + h[:, None] * sql_h + rr[None, :],
            mask=m_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        qr = tl.load(
            qr_ptr + token[:, None] * sqr_t + h[:, None] * sqr_h + dd[None, :],
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:  # fp32 dots (module docstring)
            ql, qr = ql.to(tl.float32), qr.to(tl.float32)
        lo = sp * split_len
        hi = tl.minimum(tl.minimum(lo + split_len, S), tl.max(pos, axis=0) + 1)  # nothing past the last visible
        run_max = tl.full([BM], float("-inf"), tl.float32)
        denom = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BR], tl.float32)
        for s0 in range(lo, hi, BS):
            ks = s0 + tl.arange(0, BS)
            k_ok = ks < hi
            row = tl.load(rows_ptr + n * s_rows + ks, mask=k_ok, other=0).to(tl.int64)
            lat = tl.load(kv_ptr + row[:, None] * s_kv + rr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            rope = tl.load(
                kv_ptr + row[:, None] * s_kv + R + dd[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0
            )
            lat_f = lat.to(tl.float32)
            if UPCAST:
                scores = tl.dot(ql, tl.trans(lat_f), input_precision=PREC) + tl.dot(
                    qr, tl.trans(rope.to(tl.float32)), input_precision=PREC
                )
            else:  # 16-bit inputs on tensor cores: exact products, fp32 sums
                scores = tl.dot(ql, tl.trans(lat)) + tl.dot(qr, tl.trans(rope))
            seen = (ks[None, :] <= pos[:, None]) & k_ok[None, :]
            scores = tl.where(seen, scores * scale, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing seen yet stays at 0
            rescale = tl.exp(run_max - base)
            p = tl.exp(scores - base[:, None])
            denom = denom * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + tl.dot(p, lat_f, input_precision=PREC)
            run_max = new_max
        o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        if SPLIT:  # this range's normalized output and log-sum-exp, merged by _mla_merge
            at = (n * TQ * H + m.to(tl.int64)) * tl.num_programs(2) + sp
            tl.store(part_ptr + at[:, None] * R + rr[None, :], o, mask=m_ok[:, None] & r_ok[None, :])
            tl.store(lse_ptr + at, tl.where(denom > 0, run_max + tl.log(denom), float("-inf")), mask=m_ok)
        else:
            at = n * TQ * H + m.to(tl.int64)
            tl.store(
                out_ptr + at[:, None] * R + rr[None, :],
                round_to(o, out_ptr.dtype.element_ty),
                mask=m_ok[:, None] & r_ok[None, :],
            )

    @triton.jit
    def _mla_merge(part_ptr, lse_ptr, out_ptr, SPLITS, R: tl.constexpr, BR: tl.constexpr, BSP: tl.constexpr):
        q = tl.program_id(0).to(tl.int64)  # one query row (n, t, h) of the output
        sp, rr = tl.arange(0, BSP), tl.arange(0, BR)
        lse = tl.load(lse_ptr + q * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, axis=0))  # range 0 always holds position 0, which every query sees
        parts = tl.load(
            part_ptr + (q * SPLITS + sp)[:, None] * R + rr[None, :],
            mask=(sp < SPLITS)[:, None] & (rr < R)[None, :],
            other=0.0,
        )
        o = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + q * R + rr, round_to(o, out_ptr.dtype.element_ty), mask=rr < R)


def supports(q_lat: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, hist_rows: torch.Tensor, r: int) -> bool:
    """Whether the kernel takes this call (module docstring)."""
    return (
        triton is not None
        and q_lat.dim() == 3
        and q_rope.dim() == 3
        and kv.dim() == 2
        and q_lat.shape[-1] == r
        and 0 < r <= MAX_R
        and kv.shape[-1] == r + q_rope.shape[-1]
        and q_lat.dtype == q_rope.dtype == kv.dtype
        and kv.dtype in DTYPES
        and q_lat.stride(-1) == q_rope.stride(-1) == kv.stride(-1) == 1
        and q_lat.device == kv.device == hist_rows.device
        and hist_rows.shape[1] > 0
    )


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """About two programs per SM on CUDA; elsewhere (the interpreter) a few, so CPU tests split too."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def paged_mla_attention(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    hist_rows: torch.Tensor,
    q_pos: torch.Tensor,
    q_index: torch.Tensor,
    scale: float,
    r: int,
    splits: int | None = None,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """-> o_lat [N, Tq, H, R] (module docstring)."""
    fast = (kv.is_cuda if tensor_cores is None else tensor_cores) and kv.dtype != torch.float32
    assert supports(q_lat, q_rope, kv, hist_rows, r)
    (n, s), tq = hist_rows.shape, q_pos.shape[1]
    heads, dr = q_lat.shape[1], q_rope.shape[-1]
    out = torch.empty(n, tq, heads, r, dtype=kv.dtype, device=kv.device)
    if n == 0 or tq == 0:
        return out
    br, bdr = max(16, triton.next_power_of_2(r)), max(16, triton.next_power_of_2(dr))
    bs = 32 if br <= 256 else 16
    m_blocks = triton.cdiv(tq * heads, _BM)
    if splits is None:  # a few blocks a range at least: a range's fixed cost is its queries' loads and its merge
        splits = max(1, min(_programs_wanted(kv.device) // (n * m_blocks), triton.cdiv(s, 4 * bs)))
    split_len = triton.cdiv(triton.cdiv(s, splits), bs) * bs
    splits = triton.cdiv(s, split_len)
    part = lse = out
    if splits > 1:
        part = torch.empty(n * tq * heads * splits, r, dtype=torch.float32, device=kv.device)
        lse = torch.empty(n * tq * heads * splits, dtype=torch.float32, device=kv.device)
    _mla_attention[(n, m_blocks, splits)](
        q_lat,
        q_rope,
        kv,
        hist_rows,
        q_pos,
        q_index,
        out,
        part,
        lse,
        s,
        tq,
        heads,
        split_len,
        float(scale),
        q_lat.stride(0),
        q_lat.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        kv.stride(0),
        hist_rows.stride(0),
        q_pos.stride(0),
        q_index.stride(0),
        R=r,
        DR=dr,
        BR=br,
        BDR=bdr,
        BM=_BM,
        BS=bs,
        SPLIT=splits > 1,
        UPCAST=not fast,
        PREC="tf32x3" if fast else "ieee",
        num_warps=4 if br <= 256 else 8,
    )
    if splits > 1:
        _mla_merge[(n * tq * heads,)](part, lse, out, splits, R=r, BR=br, BSP=max(2, triton.next_power_of_2(splits)))
    return out
