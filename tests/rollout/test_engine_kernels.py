"""The engine through the kernel path (`miles_k3.kernels`: norms, AttnRes, SiTU-GLU, short conv, KDA gate),
on CPU through Triton's interpreter (MILES_K3_KERNELS=interpret, in a subprocess: TRITON_INTERPRET must be set
before triton is imported): greedy decoding of a k3-tiny engine in fp32 gives the definition's tokens and
log-probs within fp32 rounding, plain and speculative (the fold steps the state with the same kernels as the
decode step), and every kernel ran. The kernels' own bounds: tests/ops/test_kernels_*.py."""

import textwrap

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

    def run(**kw):
        with kernels.interpreted_launches() as launches:
            outs = engine(max_running=4, **kw).generate(prompts, params)
        return outs, dict(launches)

    def set_mode(value):
        os.environ["MILES_K3_KERNELS"] = value
        kernels.reset()

    got, launches = run()
    assert {"_rms_norm", "_gated_rms_norm", "_attn_res_mix", "_situ_glu", "_short_conv", "_kda_gate"} <= set(launches), launches
    set_mode("0")
    want, none = run()
    assert none == {}, none
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)

    set_mode("interpret")  # speculation: verify forward and fold through the kernels, lossless against plain
    drafter = ScriptedDrafter({tuple(p): c.output_ids for p, c in zip(prompts, want)}, wrong=0.3)
    spec, launches = run(speculation=SpecConfig(drafter=drafter, gamma=3))
    assert launches.get("_kda_gate", 0) > 0
    for a, b in zip(spec, want):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    print("ok")
""")


def test_the_engine_through_the_kernels_decodes_the_definitions_tokens():
    assert_interpreted_ok(_SCRIPT, timeout=600)
