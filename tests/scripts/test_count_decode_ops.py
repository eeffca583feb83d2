"""scripts/count_decode_ops.py: compute ops of one decode step (the kernel-count proxy)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import count_decode_ops  # noqa: E402


def test_adapter_step_counts_more_ops_and_json(tmp_path):
    plain = count_decode_ops.main(["--preset", "k3-tiny"])
    out = tmp_path / "ops.json"
    adapted = count_decode_ops.main(["--preset", "k3-tiny", "--adapter", "--json", str(out)])
    assert json.loads(out.read_text()) == adapted
    assert 0 < plain["compute_ops"] < adapted["compute_ops"]  # the LoRA terms and MXFP4 decoding add ops
    assert sum(adapted["by_op"].values()) == adapted["compute_ops"]
    assert "aten::_grouped_mm" in adapted["by_op"] and not set(adapted["by_op"]) & count_decode_ops.NOT_COMPUTE


def test_conversions_are_counted_by_source_line():
    res = count_decode_ops.main(["--preset", "k3-tiny", "--conversions"])
    sites = res["conversions_by_site"]
    assert res["conversions"] == sum(sites.values()) > 0
    # the fp32 RMSNorm upcasts and casts back every norm of the bf16 step
    assert any(s.startswith("miles_k3/ops/norm.py:") and s.endswith("bfloat16->float32") for s in sites)
    assert not any(s.startswith("?") for s in sites)


def test_by_line_attributes_every_counted_op_to_a_repository_line():
    plain = count_decode_ops.main(["--preset", "k3-tiny"])
    res = count_decode_ops.main(["--preset", "k3-tiny", "--by-line", "5"])
    lines = res["by_line"]
    # the same step's count (the dispatch mode's ranges add no op), every op placed on a line of this repository
    assert res["compute_ops"] == plain["compute_ops"] == sum(sum(ops.values()) for ops in lines.values())
    assert "?" not in lines and all(":" in where and not where.startswith("/") for where in lines)
    # the router's fp32 GEMM is attributed to its op (`router_logits`), the MoE's grouped GEMMs too
    assert any(w.startswith("miles_k3/ops/router.py:") and "aten::mm" in ops for w, ops in lines.items())
    assert sum(ops.get("aten::_grouped_mm", 0) for ops in lines.values()) == plain["by_op"]["aten::_grouped_mm"]
