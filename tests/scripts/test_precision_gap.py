"""scripts/precision_gap.py: the bf16-vs-fp32 floor of a preset's log-probs, per K3 feature variant."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import precision_gap  # noqa: E402


def test_precision_gap_rows_and_json(tmp_path):
    out = tmp_path / "gap.json"
    res = precision_gap.main(["--preset", "k3-tiny", "--batch", "1", "--length", "8", "--json", str(out)])
    assert json.loads(out.read_text()) == res
    assert [r["variant"] for r in res["rows"]] == list(precision_gap.VARIANTS)
    for r in res["rows"]:
        # bf16 moves the model (not 0) and the max bounds the mean
        assert 0 < r["mean_abs_dlogp"] <= r["max_abs_dlogp"] < 10
    assert res["command"].startswith("python scripts/precision_gap.py --preset k3-tiny")
