"""scripts/bench_sequence_parallel.py: three layouts, same loss, sequence parallelism saves activations."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_sequence_parallel  # noqa: E402


def test_layouts_agree_and_sequence_parallel_saves_activations(tmp_path):
    out = tmp_path / "sp.json"
    res = bench_sequence_parallel.main(["--seq-len", "128", "--steps", "1", "--threads", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == res
    tp1, tp2, sp = res["rows"]
    assert [r["layout"] for r in res["rows"]] == list(bench_sequence_parallel.LAYOUTS)
    # the same model and tokens in every layout. (An even length: on CPU, padding 63 to 64 would move KDA from its
    # recurrent to its chunked form, whose saved intermediates are larger, and hide what SP saves.)
    assert abs(tp2["loss"] - tp1["loss"]) < 1e-5 and abs(sp["loss"] - tp1["loss"]) < 1e-5
    assert tp2["saved_mb_per_rank"] < tp1["saved_mb_per_rank"]  # heads and intermediates split
    assert sp["saved_mb_per_rank"] < tp2["saved_mb_per_rank"]  # the residual region split too
    assert all(r["step_s"] > 0 for r in res["rows"])
