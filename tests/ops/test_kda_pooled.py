"""`kda` over a `PooledState` (the engine's recurrent states stay in their slots): the op steps exactly the
indexed rows of the pool in place, to the values a gathered call gives, and leaves every other row alone.
On CUDA a decode step does that inside a recurrent kernel with state indices: ours (`miles_k3.kernels.kda_rows`,
which also reads a verify's `FrozenRows` without writing them) or fla's (MILES_K3_KERNELS=0). Both run here
through Triton's interpreter, against the gathered call, and their launches compile for sm_90
(`miles_k3.kernels.compile_check`). `kda_advance` (the speculative fold's recurrence: T tokens a row, masked
tokens no-ops) writes the state T decode steps write, bit for bit, on every path."""

import textwrap

import torch

from miles_k3.ops.kda import PooledState, kda, kda_advance
from tests.rollout.interpreted import assert_interpreted_ok, run_and_compile


def _inputs(n=5, t=1, h=2, d=32, slots=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, t, h, d, generator=g) for _ in range(3))
    gate, beta = -torch.rand(n, t, h, d, generator=g), torch.rand(n, t, h, generator=g)
    return (q, k, v, gate, beta), torch.randn(slots, h, d, d, generator=g)


def test_a_pooled_state_is_stepped_in_place_to_the_gathered_calls_values():
    for t in (1, 6):  # a decode step and a verify-sized block
        args, pool = _inputs(t=t)
        index = torch.tensor([3, 1, 7, 8, 5])
        before = pool.clone()
        o_want, ht = kda(*args, initial_state=before[index], output_final_state=True, use_qk_l2norm=True)
        o, final = kda(*args, initial_state=PooledState(pool, index), output_final_state=True, use_qk_l2norm=True)
        assert final.pool is pool and final.index is index
        assert torch.equal(o, o_want) and torch.equal(pool[index], ht)
        others = torch.tensor([0, 2, 4, 6])
        assert torch.equal(pool[others], before[others])


_FLA = textwrap.dedent("""
    import json, os
    import torch
    from fla.ops.kda import fused_recurrent_kda
    from miles_k3.kernels import interpreted_launches
    from miles_k3.ops.kda import PooledState, _kda_fla_in_place
    from tests.ops.test_kda_pooled import _inputs

    args, pool = _inputs()
    index = torch.tensor([3, 0, 7, 8, 0])  # rows 1 and 4 both on slot 0 (the engine's padding rows: the sink)
    before = pool.clone()
    real = torch.tensor([0, 2, 3])
    o_want, ht = fused_recurrent_kda(*(a[real] for a in args), initial_state=before[index[real]],
                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    record = []
    with interpreted_launches(record):
        o = _kda_fla_in_place(*args, PooledState(pool, index), None, True)
    assert torch.equal(o[real], o_want), float((o[real] - o_want).abs().max())
    assert torch.equal(pool[index[real]], ht)
    untouched = torch.tensor([1, 2, 4, 5, 6])
    assert torch.equal(pool[untouched], before[untouched])
    with open(os.environ["LAUNCHES_JSON"], "w") as f:
        json.dump(record, f)
    print("ok")
""")


def test_flas_in_place_recurrence_equals_its_gathered_call_bit_for_bit_and_compiles(tmp_path):
    assert run_and_compile(_FLA, tmp_path) == ["fused_recurrent_kda_fwd_kernel"]


def _masked_block(seed=2, n=5, t=4, counts=(0, 1, 2, 4, 3)):
    """A fold's block: row n's first counts[n] tokens are its own, the rest masked (g = beta = 0)."""
    (q, k, v, gate, beta), pool = _inputs(n=n, t=t, seed=seed)
    live = torch.arange(t)[None, :] < torch.tensor(counts)[:, None]  # [N, T]
    return (q, k, v, torch.where(live[..., None, None], gate, 0.0), torch.where(live[..., None], beta, 0.0)), pool, live


def test_advancing_a_pooled_state_by_a_masked_block_equals_its_decode_steps_bit_for_bit():
    args, pool, live = _masked_block()
    index = torch.tensor([3, 1, 7, 8, 5])
    want = pool.clone()
    for t in range(live.shape[1]):  # decode steps of the rows whose token t is live
        rows = live[:, t].nonzero()[:, 0]
        step = [a[rows, t : t + 1] for a in args]
        kda(*step, initial_state=PooledState(want, index[rows]), output_final_state=True, use_qk_l2norm=True)
    before = pool.clone()
    kda_advance(*args, PooledState(pool, index), scratch=0, use_qk_l2norm=True)
    assert torch.equal(pool[index], want[index]) and not torch.equal(pool[index], before[index])
    assert torch.equal(pool[index[0]], before[index[0]])  # a row with no live token
    others = torch.tensor([2, 4, 6])  # the scratch row (0) is free to change
    assert torch.equal(pool[others], before[others])


_FLA_ADVANCE = textwrap.dedent("""
    import torch
    from miles_k3.ops.kda import PooledState, _kda_fla_advance, _kda_fla_in_place
    from tests.ops.test_kda_pooled import _masked_block

    args, pool, live = _masked_block()
    index = torch.tensor([3, 1, 7, 8, 5])
    want = pool.clone()
    for t in range(live.shape[1]):
        rows = live[:, t].nonzero()[:, 0]
        _kda_fla_in_place(*(a[rows, t:t + 1] for a in args), PooledState(want, index[rows]), None, True)
    before = pool.clone()
    _kda_fla_advance(*args, PooledState(pool, index), 0, None, True)
    assert torch.equal(pool[index], want[index]), float((pool[index] - want[index]).abs().max())
    others = torch.tensor([2, 4, 6])
    assert torch.equal(pool[others], before[others])
    print("ok")
""")


def test_flas_kernel_advances_a_masked_block_as_its_decode_steps_bit_for_bit():
    """The CUDA path of `kda_advance` (fla's kernel over T tokens with per-token state rows) against T of the
    decode step's in-place calls, through Triton's interpreter."""
    assert_interpreted_ok(_FLA_ADVANCE, timeout=300)


_ROWS = textwrap.dedent("""
    import json, os
    import torch
    from miles_k3.kernels import interpreted_launches
    from miles_k3.kernels.kda_rows import kda_rows
    from miles_k3.ops.kda import kda
    from tests.ops.test_kda_pooled import _inputs, _masked_block

    index = torch.tensor([3, 1, 7, 8, 5])
    others = torch.tensor([0, 2, 4, 6])
    record = []
    with interpreted_launches(record):
        # read only (a verify): the gathered reference's outputs, the pool untouched
        args, pool = _inputs(t=6)
        before = pool.clone()
        o = kda_rows(*args, pool, index, scale=None, use_qk_l2norm=True, write=False)
        want, _ = kda(*args, initial_state=before[index], use_qk_l2norm=True, mode="recurrent")
        torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(pool, before)
        # packed rows (a planner's ragged verify, a row of none): each row's outputs are its unpacked call's
        lengths = [1, 6, 3, 0, 4]
        packed = [torch.cat([a[n, :c] for n, c in enumerate(lengths)])[None] for a in args]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        o_packed = kda_rows(*packed, pool, index, scale=None, use_qk_l2norm=True, write=False, cu_seqlens=cu)
        assert torch.equal(o_packed[0], torch.cat([o[n, :c] for n, c in enumerate(lengths)]))
        assert torch.equal(pool, before)
        # a masked block in one call (the fold) writes the state its single-token calls (decode steps) write
        args, pool, live = _masked_block()
        steps = pool.clone()
        for t in range(live.shape[1]):
            rows = live[:, t].nonzero()[:, 0]
            kda_rows(*(a[rows, t:t + 1] for a in args), steps, index[rows], scale=None, use_qk_l2norm=True,
                     write=True)
        before = pool.clone()
        kda_rows(*args, pool, index, scale=None, use_qk_l2norm=True, write=True)
        assert torch.equal(pool[index], steps[index]) and not torch.equal(pool[index], before[index])
        assert torch.equal(pool[index[0]], before[index[0]])  # a row with no live token
        assert torch.equal(pool[others], before[others])
        # in bf16 inputs, as the engine calls it
        args, pool = _inputs(t=1)
        ref = pool.clone()
        o = kda_rows(*(a.bfloat16() if i < 3 else a for i, a in enumerate(args)), pool, index, scale=None,
                     use_qk_l2norm=True, write=True)
        assert o.dtype == torch.bfloat16 and not torch.equal(pool[index], ref[index])
    with open(os.environ["LAUNCHES_JSON"], "w") as f:
        json.dump(record, f)
    print("ok")
""")


def test_our_pooled_recurrence_reads_or_steps_the_rows_and_a_block_equals_its_steps_bit_for_bit(tmp_path):
    """`miles_k3.kernels.kda_rows` through Triton's interpreter: read-only (a verify) gives the reference's
    outputs and leaves the pool alone, packed rows give their unpacked outputs, a masked block written in one
    call is the state its single-token calls (the decode step) write bit for bit; every launch compiles for
    sm_90."""
    assert set(run_and_compile(_ROWS, tmp_path)) == {"_kda_rows"}
