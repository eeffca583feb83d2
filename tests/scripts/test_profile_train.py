"""scripts/profile_train.py on CPU: both sides train on the same tokens and report a profile each."""

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "profile_train.py"
sys.path.insert(0, str(_PATH.parent))
_spec = importlib.util.spec_from_file_location("profile_train", _PATH)
profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile)


def test_both_sides_profile_the_same_tokens(tmp_path):
    out = profile.main(
        [
            "--device",
            "cpu",
            "--preset",
            "k3-tiny",
            "--samples",
            "2",
            "--prompt-len",
            "4",
            "--response-len",
            "12",
            "--peer-micro-batch",
            "1",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--top",
            "3",
            "--override",
            "parallel.micro_batch_tokens=16",
            "--count-ops",
            "4",
            "--json",
            str(tmp_path / "p.json"),
        ]
    )
    assert out["meta"]["tokens"] == 2 * (4 + 12)
    for side in ("miles-k3", "peft"):
        res = out[side]
        assert res["step_s"] > 0 and len(res["times_s"]) == 1 and res["busy_s"] > 0
        assert len(res["top"]) == 3 and res["top"][0]["ms"] >= res["top"][-1]["ms"]
    count = out["miles-k3"]["count"]  # every compute op counted once, the busiest source lines listed
    assert len(count["by_line"]) == 4 and count["ops"] > sum(count["by_line"].values()) > 0
    assert json.loads((tmp_path / "p.json").read_text())["miles-k3"]["step_s"] == out["miles-k3"]["step_s"]
