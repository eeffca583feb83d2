"""scripts/bench_rollout.py on k3-tiny / CPU with tiny sizes: JSON keys, sane values, the radix cache at work."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_rollout.py"
_spec = importlib.util.spec_from_file_location("bench_rollout", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# prompt 33 with 16-token prefill chunks: the leader donates checkpoints at 16 and 32, so each of the
# other n-1 samples restores 32 tokens and computes 1.
TINY = [
    "--device",
    "cpu",
    "--preset",
    "k3-tiny",
    "--dtype",
    "fp32",
    "--batch-sizes",
    "1,3",
    "--prompt-len",
    "33",
    "--gen-len",
    "4",
    "--prefill-len",
    "48",
    "--group-prompts",
    "2",
    "--group-n",
    "4",
    "--memory-gb",
    "0.02",
    "--page-size",
    "8",
    "--chunk-size",
    "16",
    "--max-prefill-tokens",
    "16",
]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bench_rollout_json_and_prefix_reuse(tmp_path):
    out = tmp_path / "bench.json"
    res = bench.main([*TINY, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))

    meta = res["meta"]
    assert meta["preset"] == "k3-tiny" and meta["device"] == "cpu" and meta["torch"] == torch.__version__
    assert meta["date"] and meta["command"].startswith("python scripts/bench_rollout.py --device cpu")

    assert set(res["decode_tok_s"]) == {"1", "3"} and all(v > 0 for v in res["decode_tok_s"].values())
    assert res["prefill_tok_s"] > 0 and res["bs1_step_ms"] > 0
    rows = res["decode"]
    assert {r["model"] for r in rows} == {"miles-k3"} and res["hf_decode_tok_s"] is res["decode_vs_hf"] is None
    assert all(r["status"] == "ok" and r["decode_tok_s"] > 0 and r["retractions"] == 0 for r in rows)
    # first decode step untimed: 4 new tokens = 1 from the prefill + 1 warmup + 2 timed, per request
    assert [r["decode_tokens"] for r in rows] == [2, 6]
    for r in rows:  # the timed steps one by one: two of them, which make up the timed seconds
        assert 0 < r["engine_step_ms_p50"] <= r["engine_step_ms_max"] <= r["decode_s"] * 1e3
        assert 0 <= r["engine_steps_over_2x_p50_ms"] <= r["decode_s"] * 1e3

    g = res["group"]
    computed, no_cache = res["prefill_tokens_computed"], res["prefill_tokens_no_cache"]
    assert no_cache == 2 * 4 * 33 and 0 < computed <= no_cache
    assert computed == 2 * (33 + 3 * 1)  # the radix cache serves 32 of 33 tokens to every follower
    assert g["cached_tokens_per_sample"] == [0, 32] and g["retractions"] == 0
    assert g["ratio"] == pytest.approx(computed / no_cache) and g["meets_target"]

    f = res["bs1_floor"]
    assert f["bandwidth_gb_s"] > 0 and 0 < f["weight_bytes_read_per_step"] < f["weight_bytes"]
    assert f["bs1_vs_floor"] == pytest.approx(res["bs1_step_ms"] / f["floor_ms"])
    one, three = rows
    for r in rows:  # every decode row carries its own batch's floor: weights read + KV + KDA state in and out
        assert r["floor_bytes"] == r["floor_weight_bytes"] + r["floor_kv_bytes"] + r["floor_state_bytes"]
        assert r["vs_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
    assert one["floor_weight_bytes"] == f["weight_bytes_read_per_step"]
    assert (
        three["floor_kv_bytes"] == 3 * one["floor_kv_bytes"]
        and three["floor_state_bytes"] == 3 * one["floor_state_bytes"]
    )
    assert one["floor_weight_bytes"] < three["floor_weight_bytes"] < f["weight_bytes"]  # more experts selected


def test_the_batch_floor_reads_every_expert_once_a_large_batch_selects_them_all():
    model = bench.build_ours(bench.K3Config.from_preset("k3-tiny"), torch.float32, torch.device("cpu"))
    total, read = bench.weight_bytes(model, batch=10_000)
    embed = model.model.embed_tokens.weight
    assert read == total - embed.numel() * embed.element_size()


def test_bench_rollout_hf_peer():
    """Most of this test's time is importing transformers' KimiLinear (and fla) once."""
    res = bench.main([*TINY, "--batch-sizes", "2", "--peer", "hf"])
    rows = {(r["model"], r["batch"]): r for r in res["decode"]}
    assert set(rows) == {
        (m, b) for m in ("miles-k3", "miles-k3 (kimi-linear form)", "transformers KimiLinear") for b in (1, 2)
    }  # bs=1 is always run: it feeds the floor
    assert all(r["status"] == "ok" and r["decode_tok_s"] > 0 for r in rows.values())
    assert set(res["hf_decode_tok_s"]) == set(res["decode_vs_hf"]) == {"1", "2"}
    for b in ("1", "2"):
        ours = rows[("miles-k3 (kimi-linear form)", int(b))]["decode_tok_s"]
        assert res["decode_vs_hf"][b] == pytest.approx(ours / res["hf_decode_tok_s"][b])


def test_rl_path_rows_decode_with_mxfp4_experts_and_the_policy_adapter():
    res = bench.main([*TINY, "--batch-sizes", "2", "--rl-path"])
    rows = {(r["model"], r["batch"]): r for r in res["decode"] if "RL" in r["model"]}
    assert set(rows) == {("miles-k3 RL (mxfp4 torch, lora)", b) for b in (1, 2)}  # the Triton rows need CUDA
    assert all(r["status"] == "ok" and r["decode_tok_s"] > 0 for r in rows.values())
    assert res["meta"]["settings"]["rl_path"] is True


def test_a_failing_workload_is_reported_and_the_others_still_run(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("group workload exploded")

    monkeypatch.setattr(bench, "bench_group", broken)
    res = bench.main([*TINY, "--batch-sizes", "1"])
    assert res["group"] == {"status": "error", "error": "RuntimeError: group workload exploded"}
    assert res["prefill_tokens_computed"] is None and res["decode_tok_s"]["1"] > 0
    assert bench.failures(res) == [res["group"]]


@pytest.mark.parametrize(
    "flags",
    [
        ["--batch-sizes", "1,x"],
        ["--batch-sizes", "0,4"],
        ["--gen-len", "2"],
        ["--memory-gb", "-1"],
        ["--peer", "vllm"],
        ["--preset", "k4"],
    ],
)
def test_bad_flag_values_exit_with_a_usage_error(flags):
    with pytest.raises(SystemExit):
        bench.main([*TINY, *flags])


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--memory-gb", "0.0001"], "--memory-gb"),
        (["--batch-sizes", "512"], "--memory-gb"),
        (["--chunk-size", "12"], "--chunk-size"),
        (["--max-prefill-tokens", "24"], "--max-prefill-tokens"),
        (["--prompt-len", "5000"], "--prompt-len"),
    ]
    + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda")]),
)
def test_bad_flag_combinations_raise_value_error_naming_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        bench.main([*TINY, *flags])
