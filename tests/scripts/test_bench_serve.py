"""scripts/bench_serve.py at tiny sizes on CPU: the server child starts and exits 0, every row has its
rates and percentiles, and the JSON written is the result returned."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_serve.py"
_spec = importlib.util.spec_from_file_location("bench_serve", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_bench_serve_rows_and_json(tmp_path):
    out = tmp_path / "serve.json"
    res = bench.main(
        ["--concurrency", "1,3", "--requests", "4", "--gen-len", "3", "--api", "openai", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    meta = res["meta"]
    assert meta["command"].startswith("python scripts/bench_serve.py --concurrency 1,3")
    assert meta["device"] == "cpu" and meta["gen_len"] == 3 and meta["threads"] == 1
    assert [(r["concurrency"], r["requests"]) for r in res["rows"]] == [(1, 4), (3, 6)]
    for r in res["rows"]:
        assert r["http_rps"] > 0 and r["engine_rps"] > 0
        assert math.isclose(r["http_over_engine"], r["http_rps"] / r["engine_rps"])
        assert math.isclose(r["http_tok_s"], 3 * r["http_rps"])  # every request made exactly gen_len tokens
        for key in ("ttft_ms", "itl_ms"):
            p = r[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"]
