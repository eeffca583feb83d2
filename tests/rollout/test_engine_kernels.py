"""The engine through the kernel path (`miles_k3.kernels`: norms, AttnRes, SiTU-GLU, short conv, KDA gate,
router, MoE dispatch and combine, the pooled KDA recurrence; the engine's paged MLA attention), on CPU
through Triton's interpreter (MILES_K3_KERNELS=interpret, in a subprocess: TRITON_INTERPRET must be set
before triton is imported): greedy decoding of a k3-tiny engine in fp32 gives the definition's tokens and
log-probs within fp32 rounding, plain and speculative, eager and through the graphs' padded functions (the
fold steps the state with the same kernels as the decode step), and every kernel ran. Each launch the run
made, and the launches of each op at k3-small's widths (tests/ops/kernel_cases.py), of the MoE dispatch at
K3's and of the MLA attention at k3-small's with a split history, then compiles for the H200 (sm_90) with
Triton's own compiler, which the interpreter does not apply (`miles_k3.kernels.compile_check`). The kernels'
own bounds: tests/ops/test_kernels_*.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.rollout.interpreted import assert_interpreted_ok

_SCRIPT = textwrap.dedent("""
    import os
    os.environ["MILES_K3_KERNELS"] = "interpret"
    import torch
    from miles_k3 import kernels
    from rollout.request import SamplingParams
    from rollout.spec import SpecConfig
    from tests.rollout.common import engine, prompt
    from tests.rollout.test_spec_engine import ScriptedDrafter

    prompts = [prompt(n, 60 + n) for n in (5, 11, 19)]
    params = SamplingParams(temperature=0, max_new_tokens=9)

    record = []

    def run(**kw):
        with kernels.interpreted_launches(record) as launches:
            outs = engine(max_running=4, **kw).generate(prompts, params)
        return outs, dict(launches)

    def set_mode(value):
        os.environ["MILES_K3_KERNELS"] = value
        kernels.reset()

    got, launches = run(mla_attention="triton")
    assert {"_rms_norm", "_gated_rms_norm", "_attn_res_mix", "_situ_glu", "_short_conv", "_kda_gate", "_kda_rows",
            "_route", "_align", "_combine", "_mla_attention"} <= set(launches), launches
    set_mode("0")
    want, none = run()
    assert none == {}, none
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)

    set_mode("interpret")  # speculation: verify forward and fold through the kernels, lossless against plain
    drafter = ScriptedDrafter({tuple(p): c.output_ids for p, c in zip(prompts, want)}, wrong=0.3)
    spec, launches = run(speculation=SpecConfig(drafter=drafter, gamma=3), mla_attention="triton")
    assert launches.get("_kda_gate", 0) > 0 and launches.get("_mla_attention", 0) > 0
    assert launches.get("_kda_rows", 0) > 0  # the verify reads the committed states where they lie
    for a, b in zip(spec, want):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)

    # the same through the graphs' padded functions (run eagerly here): the fold's block (a grouped short conv
    # over the block, the gate, our recurrence over T tokens) commits the decode steps' state
    from tests.rollout.test_spec_engine import spec_engine
    with kernels.interpreted_launches(record) as launches:
        eng = spec_engine(ScriptedDrafter({tuple(p): c.output_ids for p, c in zip(prompts, want)}, wrong=0.3),
                          graphs=True, max_running=4, mla_attention="triton")
        graphed = eng.generate(prompts, params)
    assert eng.decoder.strategy._fold_graphs.replays > 0 and launches.get("_kda_rows", 0) > 0
    for a, b in zip(graphed, want):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)

    from tests.ops.kernel_cases import op_calls  # k3-small's widths, for the compile check's specializations
    with torch.inference_mode(), kernels.interpreted_launches(record):
        for dtype in (torch.float32, torch.bfloat16):
            for op in op_calls("cpu", dtype).values():
                op()
        from miles_k3.kernels import moe_dispatch  # K3's scale: 256 decode rows x top-16 of 896 experts
        moe_dispatch.align(torch.randint(0, 896, (256, 16)), 896)
        from rollout.kernels.mla_attention import paged_mla_attention  # k3-small's MLA, a history in 3 ranges
        for dtype in (torch.float32, torch.bfloat16):
            kv = torch.randn(300, 256 + 64).to(dtype)
            paged_mla_attention(torch.randn(2, 8, 256).to(dtype), torch.randn(2, 8, 64).to(dtype), kv,
                                torch.randint(0, 300, (2, 200)), torch.tensor([[150], [199]]),
                                torch.tensor([[0], [1]]), 0.06, 256, splits=3, tensor_cores=True)  # the device's
    with open(os.environ["LAUNCHES_JSON"], "w") as f:
        json.dump(record, f)
    print("ok")
""")


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels") / "launches.json"
    os.environ["LAUNCHES_JSON"] = str(path)
    try:
        assert_interpreted_ok("import json, os\n" + _SCRIPT, timeout=600)
    finally:
        del os.environ["LAUNCHES_JSON"]
    return path


def test_the_engine_through_the_kernels_decodes_the_definitions_tokens(launches):
    assert launches.exists()


def test_every_launch_of_the_run_compiles_for_the_h200(launches):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "miles_k3.kernels.compile_check", str(launches), "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    kernels = {spec["kernel"].split(":")[1] for spec in json.loads(launches.read_text())}
    assert {
        "_rms_norm",
        "_gated_rms_norm",
        "_attn_res_mix",
        "_situ_glu",
        "_short_conv",
        "_kda_gate",
        "_kda_rows",
        "_route",
        "_align",
        "_combine",
        "_mla_attention",
        "_mla_merge",
    } <= kernels, kernels
