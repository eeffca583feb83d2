"""The paged MLA attention kernel (rollout/kernels/mla_attention.py) on CPU through Triton's interpreter,
against an fp64 reference of the absorbed attention over the same pages (tests/rollout/mla_cases.py): decode,
verify-sized and prefill query blocks, ragged histories with padded queries and a history padded past every
request's end (a CUDA graph bucket), heads that do not fill a tile, one range and split ranges merged, fp32
and bf16. The engine through it: tests/rollout/test_engine_kernels.py."""

from tests.rollout.interpreted import assert_interpreted_ok


def test_paged_mla_kernel_equals_the_absorbed_attention_in_fp64():
    assert_interpreted_ok("from tests.rollout.mla_cases import run_all\nrun_all()\nprint('ok')", timeout=600)


def test_mla_attention_is_validated_and_auto_takes_the_kernel_only_on_cuda():
    import pytest

    from rollout.config import EngineConfig
    from rollout.engine import Engine
    from tests.rollout.common import MODEL

    with pytest.raises(ValueError, match="EngineConfig.mla_attention must be one of"):
        EngineConfig(memory_bytes=1 << 20, mla_attention="flash")
    with pytest.raises(ValueError, match="mla_attention='triton' needs the model on CUDA"):
        Engine(MODEL, EngineConfig(memory_bytes=4 << 20, mla_attention="triton"))
    engine = Engine(MODEL, EngineConfig(memory_bytes=4 << 20))  # "auto" on a CPU model: the torch path
    assert engine.runner.mla_attention == "torch" and engine.runner.kv.attention == "torch"
