"""scripts/count_spec_ops.py: the DSpark drafter's ops per verify step, by batch size."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import count_spec_ops  # noqa: E402


def test_the_drafters_context_work_does_not_grow_with_the_batch(tmp_path):
    out = tmp_path / "ops.json"
    rows = count_spec_ops.main(["--batch-sizes", "2,12", "--gen-len", "8", "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    small, large = rows
    assert small["steps"] > 0 and large["steps"] > 0 and small["propose_ops_per_step"] > 0
    # the context windows are read and appended with a gather each: no op per row
    assert large["observe_ops_per_step"] == small["observe_ops_per_step"] > 0
