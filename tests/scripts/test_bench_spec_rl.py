"""scripts/bench_spec_rl.py: two speculating GRPO runs (drafter frozen, drafter distilled online), a row per
step with both runs' acceptance and the distillation's TV, in the table and the JSON."""

import json
import sys
from pathlib import Path

from tests.trainer.recipes import random_drafter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_spec_rl  # noqa: E402


def test_two_runs_rows_per_step_and_json(tmp_path, capsys):
    random_drafter(tmp_path / "drafter")
    out = tmp_path / "result.json"
    res = bench_spec_rl.main(
        [
            "--recipe",
            "k3_grpo",
            "--drafter",
            str(tmp_path / "drafter"),
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--samples-per-prompt",
            "4",
            "--distill-steps",
            "1",
            "--out",
            str(tmp_path / "runs"),
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert [r["step"] for r in res["steps"]] == [1, 2]
    for r in res["steps"]:
        for name in bench_spec_rl.RUNS:
            assert r[f"{name}_spec_accept_len"] >= 1.0 and 0.0 <= r[f"{name}_spec_draft_acceptance"] <= 1.0
            assert r[f"{name}_spec_verify_tokens"] > 0
        assert 0.0 <= r["drafter_tv_after"] <= 1.0  # the distilled run distilled every step
    assert (tmp_path / "runs" / "frozen" / "metrics.jsonl").is_file()
    frozen = [json.loads(line) for line in (tmp_path / "runs" / "frozen" / "metrics.jsonl").read_text().splitlines()]
    assert not any("drafter_tv_after" in r for r in frozen)  # the frozen run never distils
    table = capsys.readouterr().out
    assert "| step | accept len frozen | accept len distilled |" in table and "second half of the run" in table
    assert res["command"].startswith("python scripts/bench_spec_rl.py --recipe k3_grpo")
