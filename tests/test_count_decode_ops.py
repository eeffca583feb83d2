"""scripts/count_decode_ops.py: compute ops of one decode step (the kernel-count proxy)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import count_decode_ops  # noqa: E402


def test_adapter_step_counts_more_ops_and_json(tmp_path):
    plain = count_decode_ops.main(["--preset", "k3-tiny"])
    out = tmp_path / "ops.json"
    adapted = count_decode_ops.main(["--preset", "k3-tiny", "--adapter", "--json", str(out)])
    assert json.loads(out.read_text()) == adapted
    assert 0 < plain["compute_ops"] < adapted["compute_ops"]  # the LoRA terms and MXFP4 decoding add ops
    assert sum(adapted["by_op"].values()) == adapted["compute_ops"]
    assert "aten::_grouped_mm" in adapted["by_op"] and not set(adapted["by_op"]) & count_decode_ops.NOT_COMPUTE
