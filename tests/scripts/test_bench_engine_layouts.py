"""scripts/bench_engine_layouts.py on CPU (k3-tiny, fp32, gloo): every sharded layout's greedy tokens equal the
one-process engine's, DCP=2 doubles the logical KV a device holds, the JSON is the table's rows, a layout that
fails is a row naming its error, and an unknown layout stops the script by name."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_engine_layouts  # noqa: E402


def test_sharded_layouts_decode_the_single_engines_greedy_tokens(tmp_path):
    out = tmp_path / "layouts.json"
    rows = bench_engine_layouts.main(
        [
            "--layouts",
            "single,tp2_dcp2,ep2",
            "--batch-sizes",
            "1,3",
            "--prompt-len",
            "20",
            "--gen-len",
            "5",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["rows"] == rows
    assert [(r["layout"], r["batch"]) for r in rows] == [(n, b) for n in ("single", "tp2_dcp2", "ep2") for b in (1, 3)]
    for r in rows:
        assert r["status"] == "ok" and r["agree"] == 1.0 and r["prefix"] == 1.0 and r["decode_tok_s"] > 0
    kv = {r["layout"]: r["kv_vs_single"] for r in rows}
    assert kv["tp2_dcp2"] == pytest.approx(2.0, rel=0.01) and kv["ep2"] == 1.0


def test_a_layout_that_fails_is_a_row_naming_its_error():
    rows = bench_engine_layouts.main(
        [
            "--layouts",
            "single,tp2",
            "--batch-sizes",
            "2",
            "--prompt-len",
            "8",
            "--gen-len",
            "4",
            "--memory-gb",
            "0.00001",
        ]
    )
    assert [r["layout"] for r in rows] == ["single", "tp2"]
    for r in rows:
        assert r["status"].startswith("failed: ") and "memory budget" in r["status"]


def test_an_unknown_layout_is_named(capsys):
    with pytest.raises(SystemExit):
        bench_engine_layouts.main(["--layouts", "single,tp3"])
    assert "unknown tp3" in capsys.readouterr().err
