"""scripts/bench_exact.py through the real miles-train: both arms run, exact mode's gap is 0 and its cost a ratio."""

import importlib.util
import json
import sys
from pathlib import Path

_DIR = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(_DIR))  # its sibling bench_routing, as when run as a script
_spec = importlib.util.spec_from_file_location("bench_exact", _DIR / "bench_exact.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_both_arms_run_and_report(tmp_path):
    small = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "cluster.threads_per_worker=1"]
    out = tmp_path / "rows.json"
    rows = bench.main(["--steps", "2", "--work-dir", str(tmp_path), "--json", str(out), *small])
    assert [r["exact"] for r in rows] == [False, True] and json.loads(out.read_text()) == rows
    plain, exact = rows
    assert (
        exact["train_rollout_logprob_abs_diff_max"] == 0.0 and exact["train_rollout_logprob_abs_diff_max_first"] == 0.0
    )
    assert plain["train_rollout_logprob_abs_diff_max"] > 0.0  # the builds' own orders round apart
    assert all(exact[f"{name}_ratio"] > 0 for name in ("rollout_s", "train_s", "step_s"))
    assert plain["steps"] == exact["steps"] == 2
