"""scripts/bench_grpo_trl.py without TRL (not a test dependency): our side through the real CLI, and the
transformers tokenizer it hands TRL, which must give our ids."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_grpo_trl.py"
sys.path.insert(0, str(_PATH.parent))
_spec = importlib.util.spec_from_file_location("bench_grpo_trl", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_tokenizer_for_trl_matches_the_task_tokenizer():
    from miles_k3.tasks.arithmetic import ArithmeticTokenizer

    ours, hf = ArithmeticTokenizer(), bench.hf_tokenizer()
    for text in ["7-3=", "120+45=", "9*9= 81"]:
        assert hf(text)["input_ids"] == ours.encode(text, add_bos=True)
    ids = ours.encode("12+3=15", add_bos=True) + [ours.eos_token_id]
    assert hf.decode(ids, skip_special_tokens=True) == "12+3=15"
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert bench.arithmetic_reward(None, ["15", "14"], label=[15, 15]) == [1.0, 0.0]


def test_our_side_runs_and_reports(tmp_path):
    out = bench.main(
        [
            "--device",
            "cpu",
            "--preset",
            "k3-tiny",
            "--steps",
            "2",
            "--prompts",
            "2",
            "--samples",
            "2",
            "--max-new-tokens",
            "4",
            "--skip-trl",
            "--work-dir",
            str(tmp_path),
            "--ours-override",
            "rollout.max_running=3",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    (row,) = out["rows"]
    (raw,) = out["raw"].values()
    assert raw["command"].endswith(f"rollout.max_running=3 hydra.run.dir={tmp_path / 'ours_kimi'}")
    assert row["system"].startswith("miles-k3") and row["step_s"] > 0 and row["speedup_vs_trl"] is None
    assert row["samples_per_s"] == 4 / row["step_s"] and row["adapter_sync_ms"] > 0
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == out["rows"]
    # the Kimi-Linear base both sides load is an HF checkpoint transformers reads
    config = json.loads((tmp_path / "kimi-linear-base" / "config.json").read_text())
    assert config["model_type"] == "kimi_linear" and config["vocab_size"] == 32
    assert (tmp_path / "ours_kimi.log").exists()
    # --reuse: a finished run in --work-dir is read back, not run again (a cut device call continues)
    log_time = (tmp_path / "ours_kimi.log").stat().st_mtime_ns
    again = bench.main(
        [
            "--device",
            "cpu",
            "--preset",
            "k3-tiny",
            "--steps",
            "2",
            "--prompts",
            "2",
            "--samples",
            "2",
            "--max-new-tokens",
            "4",
            "--skip-trl",
            "--work-dir",
            str(tmp_path),
            "--reuse",
        ]
    )
    assert again["rows"] == out["rows"] and (tmp_path / "ours_kimi.log").stat().st_mtime_ns == log_time
    with pytest.raises(ValueError, match="--reuse needs --work-dir"):
        bench.main(["--device", "cpu", "--skip-trl", "--reuse"])
    with pytest.raises(ValueError, match="leaves nothing to run"):
        bench.main(["--device", "cpu", "--skip-trl", "--skip-ours"])


def test_ignore_eos_runs_every_completion_to_its_length(tmp_path):
    bench.main(
        [
            "--device",
            "cpu",
            "--preset",
            "k3-tiny",
            "--steps",
            "2",
            "--prompts",
            "2",
            "--samples",
            "2",
            "--max-new-tokens",
            "40",
            "--ignore-eos",
            "--skip-trl",
            "--work-dir",
            str(tmp_path),
        ]
    )
    rows = [json.loads(line) for line in (tmp_path / "ours_kimi" / "metrics.jsonl").read_text().splitlines()]
    lengths = [r["response_len_mean"] for r in rows if "response_len_mean" in r]
    assert lengths and all(n == 40 for n in lengths)  # a random base would stop at its first eos
