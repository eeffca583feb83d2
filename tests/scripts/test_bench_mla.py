"""scripts/bench_mla.py on CPU: its torch-path inputs are the engine's (the gathered attention over them equals
an fp64 reference per request), the table's JSON, and bad flags."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from miles_k3.model import K3Config

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_mla.py"
_spec = importlib.util.spec_from_file_location("bench_mla", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_benchmarked_torch_path_is_the_attention_over_each_requests_history():
    x = bench.inputs(K3Config.from_preset("k3-tiny"), 3, 20, torch.float32, "cpu", 0)
    got = bench.gathered_attention(x["q_lat"], x["q_rope"], x["buf"], x["lay"], x["scale"], x["r"], x["hidden"])
    buf = x["buf"].double()
    for n in range(3):
        keys = buf[x["lay"].hist_rows[n]]  # all 20 positions: the query sits at the last
        q = torch.cat([x["q_lat"][n], x["q_rope"][n]], -1).double()
        want = torch.softmax(q @ keys.T * x["scale"], -1) @ keys[:, : x["r"]]
        torch.testing.assert_close(got[n].double(), want, rtol=1e-5, atol=1e-6)


def test_bench_mla_writes_its_rows(tmp_path):
    out = tmp_path / "mla.json"
    res = bench.main(
        [
            "--device",
            "cpu",
            "--preset",
            "k3-tiny",
            "--dtype",
            "float32",
            "--batch-sizes",
            "1,2",
            "--histories",
            "16",
            "--steps",
            "2",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert [(r["batch"], r["history"]) for r in res["rows"]] == [(1, 16), (2, 16)]
    assert all(r["torch_us"] > 0 and "kernel_us" not in r for r in res["rows"])  # the kernel needs CUDA
    assert res["command"].startswith("python scripts/bench_mla.py --device cpu")


def test_bench_mla_rejects_bad_sizes():
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--batch-sizes", "0,4"])
