"""Cases for the paged MLA attention kernel (rollout/kernels/mla_attention.py) against an fp64 reference of
the absorbed attention over the same pages; run on CPU through the interpreter (tests/rollout/
test_mla_kernel.py) and compiled on CUDA (tests/gpu/test_decode_kernels.py)."""

import torch

from rollout.kernels.mla_attention import paged_mla_attention, supports


def check_case(
    heads: int,
    r: int,
    dr: int,
    positions: list[int],
    lengths: list[int],
    pad: int,
    dtype: torch.dtype,
    splits: int | None,
    seed: int,
    device: str = "cpu",
) -> None:
    """Requests with `positions[n]` computed tokens bring `lengths[n]` queries; the history is padded `pad`
    positions past the longest (a graph bucket), its rows scattered over a pool whose row 0 is zero."""
    g = torch.Generator().manual_seed(seed)
    n, tq = len(positions), max(lengths)
    ends = [p + t for p, t in zip(positions, lengths)]
    s = max(ends) + pad
    rows = 3 * sum(ends) + 5
    kv = torch.randn(rows, r + dr, generator=g).to(dtype)
    kv[0] = 0  # the zero row past each request's end
    perm = torch.randperm(rows - 1, generator=g) + 1
    hist = torch.zeros(n, s, dtype=torch.long)
    q_pos = torch.zeros(n, tq, dtype=torch.long)
    q_index = torch.zeros(n, tq, dtype=torch.long)
    start = used = 0
    for i, (p, t) in enumerate(zip(positions, lengths)):
        hist[i, : p + t] = perm[used : used + p + t]
        used += p + t
        q_pos[i, :t] = torch.arange(p, p + t)
        q_index[i, :t] = torch.arange(start, start + t)
        start += t
    q = torch.randn(start, heads, 40 + dr, generator=g).to(dtype)
    q_lat = torch.randn(start, heads, r, generator=g).to(dtype)
    q_rope = q[..., 40:]  # a strided view, as the engine's split of the projected q is
    scale = (r + dr) ** -0.5
    kv, hist, q_pos, q_index, q_lat, q_rope = (x.to(device) for x in (kv, hist, q_pos, q_index, q_lat, q_rope))
    assert supports(q_lat, q_rope, kv, hist, r)
    got = paged_mla_attention(q_lat, q_rope, kv, hist, q_pos, q_index, scale, r, splits=splits)
    assert got.shape == (n, tq, heads, r) and got.dtype == dtype
    kv64, got = kv.double().cpu(), got.double().cpu()
    qf = torch.cat([q_lat, q_rope], -1).double().cpu()
    for i, (p, t) in enumerate(zip(positions, lengths)):
        for j in range(t):
            keys = kv64[hist[i, : p + j + 1].cpu()]
            want = torch.softmax(qf[q_index[i, j].item()] @ keys.T * scale, dim=-1) @ keys[:, :r]
            if dtype == torch.float32:
                torch.testing.assert_close(got[i, j], want, rtol=1e-5, atol=1e-5)
            else:  # the fp32 result rounded once: within one bf16 ulp of the exact one
                err = (got[i, j] - want).abs()
                assert bool((err <= want.abs() * 2.0**-8 + 1e-6).all()), (heads, r, splits, float(err.max()))


def run_all(device: str = "cpu") -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for splits in (1, 3, None):
            check_case(8, 32, 16, [5], [1], 0, dtype, splits, 0, device)  # a decode row
            check_case(8, 64, 16, [0, 7, 130, 2, 90], [1] * 5, 17, dtype, splits, 1, device)  # a bucket's padding
            check_case(4, 32, 16, [70, 12], [4, 2], 9, dtype, splits, 2, device)  # verify blocks, padded queries
            check_case(20, 32, 16, [0, 75], [9, 3], 0, dtype, splits, 3, device)  # prefill chunks; two head tiles
    check_case(8, 256, 64, [40, 3], [1, 1], 30, torch.bfloat16, None, 4, device)  # k3-small's widths
