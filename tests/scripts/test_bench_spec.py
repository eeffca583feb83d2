"""scripts/bench_spec.py on the embedded tiny K3 with an untrained drafter: one row per batch, temperature,
planner and rollback; greedy rows are lossless; the snapshot baseline's measured window is gamma state
snapshots, larger than ReplaySSM's, so fewer requests fit the same pool."""

import json
import sys
from pathlib import Path

import torch

from miles_k3.model import K3Config
from rollout.memory import PoolSizes
from rollout.spec.drafter import DSparkConfig, DSparkDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_spec  # noqa: E402


def test_rows_for_each_rollback_with_measured_windows_and_fitting_batches(tmp_path):
    config = K3Config.from_json_file(bench_spec.ASSET / "config.json")
    torch.manual_seed(0)
    DSparkDrafter(
        DSparkConfig(
            target_layers=(1, 4),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            block_size=3,
            context_window=16,
        )
    ).save(tmp_path / "drafter")
    out = tmp_path / "bench.json"
    bench_spec.main(
        [
            "--drafter",
            str(tmp_path / "drafter"),
            "--batch-sizes",
            "2",
            "--gen-len",
            "4",
            "--rollback",
            "replay,snapshot",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["temperature"], r["rollback"]) for r in rows] == [
        (2, t, rb) for t in (0.0, 1.0) for rb in ("replay", "snapshot")
    ]
    assert all(r["lossless"] for r in rows if r["temperature"] == 0)
    slot = PoolSizes.bytes_per_slot(config, torch.float32)
    for r in rows:
        if r["rollback"] == "snapshot":
            assert r["window_bytes_per_request"] == 3 * slot
        else:
            assert 0 < r["window_bytes_per_request"] < slot
    by = {(r["batch"], r["temperature"], r["rollback"]): r["fit_batch"] for r in rows}
    assert all(by[(b, t, "replay")] > by[(b, t, "snapshot")] > 0 for b in (2,) for t in (0.0, 1.0))


def test_a_controlled_drafter_on_a_random_preset_is_lossless_at_its_set_acceptance(tmp_path):
    """--drafter controlled:P drafts the target's own greedy continuation (each draft kept with probability
    P): P = 1 accepts every draft of a full block, P = 0 none, and both leave the greedy tokens unchanged."""
    out = tmp_path / "bench.json"
    bench_spec.main(
        [
            "--target",
            "preset:k3-tiny",
            "--drafter",
            "controlled:1.0",
            "--temperatures",
            "0",
            "--batch-sizes",
            "3",
            "--prompt-len",
            "10",
            "--gen-len",
            "11",
            "--gamma",
            "4",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    (full,) = json.loads(out.read_text())["rows"]
    bench_spec.main(
        [
            "--target",
            "preset:k3-tiny",
            "--drafter",
            "controlled:0",
            "--temperatures",
            "0",
            "--batch-sizes",
            "3",
            "--prompt-len",
            "10",
            "--gen-len",
            "11",
            "--gamma",
            "4",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    (none,) = json.loads(out.read_text())["rows"]
    bench_spec.main(
        [
            "--target",
            "preset:k3-tiny",
            "--drafter",
            "controlled:1.0",
            "--temperatures",
            "0",
            "--batch-sizes",
            "3",
            "--prompt-len",
            "10",
            "--gen-len",
            "11",
            "--gamma",
            "4",
            "--threads",
            "1",
            "--max-batch",
            "2",
            "--json",
            str(out),
        ]
    )
    (gated,) = json.loads(out.read_text())["rows"]  # three rows over --max-batch 2: plain steps at first
    assert gated["lossless"] and gated["plain_steps"] > 0 and full["plain_steps"] == none["plain_steps"] == 0
    assert full["lossless"] and none["lossless"]
    assert none["draft_acceptance"] == 0 and none["mean_tokens_per_verify"] == 1
    assert full["draft_acceptance"] == 1 and full["mean_tokens_per_verify"] > 3  # blocks of 5, cut at the length limit


def test_a_controlled_drafter_of_mixed_rates_is_lossless_and_confident_as_its_rows(tmp_path):
    """controlled:LO-HI: a rate per prompt inside the range, drafts kept at it, and the drafts' confidence is
    that rate (the planner's ranking signal); greedy output is still the target's."""
    import controlled_drafter

    d = controlled_drafter.ControlledDrafter({(1,): [3] * 8, (2,): [4] * 8, (3,): [5] * 8}, 16, (0.2, 0.9))
    assert sorted(d.rates) == [(1,), (2,), (3,)] and all(0.2 <= r <= 0.9 for r in d.rates.values())
    assert len(set(d.rates.values())) == 3
    out = tmp_path / "bench.json"
    bench_spec.main(
        [
            "--target",
            "preset:k3-tiny",
            "--drafter",
            "controlled:0.2-0.9",
            "--temperatures",
            "0",
            "--batch-sizes",
            "4",
            "--prompt-len",
            "8",
            "--gen-len",
            "9",
            "--planners",
            "verify_all,cost_aware",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["lossless"] for r in rows)
    assert 0 < rows[0]["draft_acceptance"] < 1
    import pytest

    with pytest.raises(ValueError, match="controlled:LO-HI"):
        bench_spec.acceptance_of("controlled:lots")


def test_a_controlled_drafter_refuses_sampled_rows():
    import pytest

    with pytest.raises(ValueError, match="greedy rows only"):
        bench_spec.main(["--target", "preset:k3-tiny", "--drafter", "controlled:0.5", "--batch-sizes", "1"])


def test_a_controlled_drafter_with_a_dspark_shadow_keeps_its_acceptance_and_runs_the_shadow(tmp_path, monkeypatch):
    """--drafter-cost dspark: an untrained DSpark drafter rides along (taps, windows from the prefill and every
    verify, a block forward per step) and its drafts are dropped: greedy output is still the target's and every
    draft is kept at rate 1, as without it; a non-controlled drafter refuses the flag by name."""
    import pytest

    made = []
    build = bench_spec.shadow_drafter
    monkeypatch.setattr(
        bench_spec, "shadow_drafter", lambda config, gamma: made.append(build(config, gamma)) or made[-1]
    )
    out = tmp_path / "bench.json"
    bench_spec.main(
        [
            "--target",
            "preset:k3-tiny",
            "--drafter",
            "controlled:1.0",
            "--drafter-cost",
            "dspark",
            "--temperatures",
            "0",
            "--batch-sizes",
            "3",
            "--prompt-len",
            "10",
            "--gen-len",
            "11",
            "--gamma",
            "4",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["meta"]["drafter_cost"] == "dspark"
    assert row["lossless"] and row["draft_acceptance"] == 1 and row["mean_tokens_per_verify"] > 3
    (shadow,) = made
    assert shadow.taps and shadow.contexts.ids()  # attached to the target, its windows filled
    with pytest.raises(ValueError, match="--drafter-cost"):
        bench_spec.main(["--drafter", str(tmp_path / "none"), "--drafter-cost", "dspark"])
