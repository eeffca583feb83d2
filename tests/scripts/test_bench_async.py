"""scripts/bench_async.py: the colocated run and an HTTP run one version ahead, through the real miles-train and
miles-serve processes; both report the same total samples and the ahead arm its staleness."""

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_async.py"
_spec = importlib.util.spec_from_file_location("bench_async", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_colocated_and_one_version_ahead_run_and_report(tmp_path):
    small = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]
    out = tmp_path / "rows.json"
    args = ["--recipe", "k3_grpo", "--steps", "3", "--staleness", "1", "--servers", "1", "--work-dir", str(tmp_path)]
    rows = bench.main([*args, "--json", str(out), *small])
    assert [r["arm"] for r in rows] == ["colocated", "http k=1"] and json.loads(out.read_text()) == rows
    colocated, ahead = rows
    assert colocated["steps"] == ahead["steps"] == 3 and colocated["speedup"] == 1.0
    assert colocated["staleness_mean"] == 0.0 < ahead["staleness_mean"] <= 1.0
    assert colocated["rewards"][0] == ahead["rewards"][0]  # step 1 samples the same adapter with the same seeds
