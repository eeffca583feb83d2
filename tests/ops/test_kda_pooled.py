"""`kda` over a `PooledState` (the engine's recurrent states stay in their slots): the op steps exactly the
indexed rows of the pool in place, to the values a gathered call gives, and leaves every other row alone.
On CUDA a decode step does that inside fla's recurrent kernel (its continuous-batching state indices); that
kernel runs here through Triton's interpreter, against fla's own gathered call bit for bit, and its launch
compiles for sm_90 (`miles_k3.kernels.compile_check`)."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from miles_k3.ops.kda import PooledState, kda
from tests.rollout.interpreted import assert_interpreted_ok


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
    path = tmp_path / "launches.json"
    os.environ["LAUNCHES_JSON"] = str(path)
    try:
        assert_interpreted_ok(_FLA, timeout=300)
    finally:
        del os.environ["LAUNCHES_JSON"]
    assert [s["kernel"].split(":")[1] for s in json.loads(path.read_text())] == ["fused_recurrent_kda_fwd_kernel"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "miles_k3.kernels.compile_check", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
