"""scripts/bench_routing.py through the real miles-train: both arms run and report their routing metrics."""

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_routing.py"
_spec = importlib.util.spec_from_file_location("bench_routing", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_both_arms_run_and_report(tmp_path):
    small = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "cluster.threads_per_worker=1"]
    out = tmp_path / "rows.json"
    rows = bench.main(["--steps", "2", "--work-dir", str(tmp_path), "--json", str(out), *small])
    assert [r["replay"] for r in rows] == ["off", "rollout"] and json.loads(out.read_text()) == rows
    for r in rows:
        assert r["steps"] == 2 and 0.0 < r["routing_agreement"] <= 1.0
        assert r["routing_agreement_min_layer"] <= r["routing_agreement"]
        assert r["train_rollout_logprob_abs_diff_max"] >= r["train_rollout_logprob_abs_diff"] >= 0.0
    again = bench.main(["--steps", "2", "--work-dir", str(tmp_path), "--reuse", "--arms", "rollout", *small])
    assert again[0] == rows[1]  # the finished arm is read back, not run again
