"""scripts/bench_layouts.py: a layout's `miles-train` run is read back against the single rank's (TP=2 and EP=2 on
two gloo processes: the same step-1 rewards, loss and gradient norm), a failing run is a row naming its error while the
next layout still runs, and an unknown layout fails by name before anything runs."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_layouts  # noqa: E402

SMALL = [
    "--set",
    "rollout.prompts_per_step=4",
    "--set",
    "rollout.samples_per_prompt=4",
    "--set",
    "data.eval_max_prompts=16",
    "--set",
    "cluster.threads_per_worker=1",
]


def test_layouts_are_read_back_against_the_single_rank(tmp_path, capsys):
    """TP=2, and EP=2 with 64-token micro-batches: its data-parallel shares cut into different counts, which
    hung the expert dispatch until the ranks ran equally many (`micro_batches.even_out`)."""
    out = tmp_path / "layouts.json"
    bench_layouts.main(
        [
            "--layouts",
            "single,tp2,ep2",
            "--steps",
            "1",
            *SMALL,
            "--set",
            "parallel.micro_batch_tokens=64",
            "--work-dir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
            "--timeout",
            "240",
        ]
    )
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert [r["status"] for r in rows.values()] == ["ok"] * 3, rows
    for name in ("tp2", "ep2"):
        r = rows[name]
        assert r["same_rewards"] and r["loss_diff"] < 1e-5 and r["grad_norm_rel_diff"] < 1e-4, r
        assert r["scaling_efficiency"] > 0
    assert rows["single"]["scaling_efficiency"] == pytest.approx(1.0)
    assert "| ep2 | 2 | ok |" in capsys.readouterr().out


def test_a_failing_run_is_a_row_and_the_next_layout_runs(tmp_path):
    out = tmp_path / "layouts.json"
    bench_layouts.main(
        [
            "--layouts",
            "tp2,single",
            "--steps",
            "1",
            *SMALL,
            "--set",
            "parallel.tp=3",
            "--work-dir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
            "--timeout",
            "300",
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["tp2", "single"]
    assert all(r["status"].startswith("failed: ") and "tp" in r["status"] for r in rows)


def test_an_unknown_layout_fails_by_name():
    with pytest.raises(SystemExit):
        bench_layouts.parse_args(["--layouts", "single,tp9"])
