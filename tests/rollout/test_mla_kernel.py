"""The paged MLA attention kernel (rollout/kernels/mla_attention.py) on CPU through Triton's interpreter,
against an fp64 reference of the absorbed attention over the same pages (tests/rollout/mla_cases.py): decode,
verify-sized and prefill query blocks, ragged histories with padded queries and a history padded past every
request's end (a CUDA graph bucket), heads that do not fill a tile, one range and split ranges merged, fp32
and bf16. The engine through it: tests/rollout/test_engine_kernels.py."""

from tests.rollout.interpreted import assert_interpreted_ok


def test_paged_mla_kernel_equals_the_absorbed_attention_in_fp64():
    assert_interpreted_ok("from tests.rollout.mla_cases import run_all\nrun_all()\nprint('ok')", timeout=600)
