"""SGLang's RL control API on a live server, driven by httpx and the official `openai` client: adapters loaded
(from a PEFT directory and from tensors in the body), served and unloaded; memory released and resumed;
generation paused in place and continued with requests in flight; one request and all aborted (finish_reason
abort, never a 5xx); the weight version in meta_info; /get_server_info and /metrics counting it all. After
each, the engine's accounting holds (`check_invariants`) and, once flushed, both pools are full again."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import openai
import pytest

from miles_k3.model.lora_spec import LoraSpec
from rollout.request import SamplingParams
from rollout.server.app import Server
from rollout.server.loading import build_served
from tests.server.common import ADAPTER, MODEL, config, run_on_loop, wait_idle

LONG = {"temperature": 0, "max_new_tokens": 150, "ignore_eos": True}


@pytest.fixture(scope="module")
def ctl():
    """A server with two free adapter slots and a pool smaller than max_seq_len (1 MiB: 1360 tokens)."""
    cfg = config(memory_mb=1.0, max_seq_len=2048)
    served = build_served(cfg.engine_spec(lora=LoraSpec(rank=4, alpha=8.0), max_adapters=2), "arithmetic", MODEL)
    server = Server(served, max_queued=64, port=0).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(ctl):
    with httpx.Client(base_url=ctl.url, timeout=60) as c:
        yield c


def settled(server: Server, full: bool = False) -> dict:
    """Idle, the accounting rebuilt; with `full`, the cache flushed and both pools back to full."""
    wait_idle(server)
    run_on_loop(server, lambda e: e.check_invariants())
    if full:
        assert httpx.post(f"{server.url}/flush_cache").status_code == 200
    state = httpx.get(f"{server.url}/get_server_info").json()["internal_states"][0]
    if full:
        assert state["kv_pages_used"] == 0 and state["kda_slots_used"] == 0
        assert state["kv_pages_total"] > 0 and state["kda_slots_total"] > 0
    return state


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["out"] = fn(*args)
        except Exception as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    return http.post(path, json=body)


def until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def running(server: Server) -> int:
    return run_on_loop(server, lambda e: len(e.scheduler.running) + len(e.scheduler.waiting))


def test_an_adapter_loads_serves_and_unloads_through_sglangs_routes(ctl, http, adapter_dir, reference):
    tok = reference.tokenizer
    ids = tok.encode("12+7=")
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    want = reference.engine.generate([ids], params, adapter=ADAPTER)[0]  # the twin serves the same PEFT dir
    r = http.post("/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapter_dir)})
    assert r.status_code == 200 and r.json()["success"] and "a1" in r.json()["loaded_adapters"]
    files = {p.name: p for p in adapter_dir.iterdir()}
    body = {
        "lora_name": "a2",
        "config_dict": json.loads(files["adapter_config.json"].read_text()),
        "serialized_tensors": base64.b64encode(files["adapter_model.safetensors"].read_bytes()).decode(),
        "load_format": "safetensors",
    }
    assert http.post("/load_lora_adapter_from_tensors", json=body).json()["success"]
    for name in ("a1", "a2"):
        out = http.post(
            "/generate",
            json={
                "input_ids": ids,
                "lora_path": name,
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 6},
            },
        ).json()
        assert out["output_ids"] == want.output_ids
        assert [e[0] for e in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want.logprobs, abs=1e-4)
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL, "a1", "a2"]
    full = http.post("/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapter_dir)})
    assert full.status_code == 400 and "slots" in full.json()["error_message"]
    assert http.post("/unload_lora_adapter", json={"lora_name": "a1"}).json()["loaded_adapters"] == {"a2": "__tensor__"}
    gone = http.post("/generate", json={"text": "1+1=", "lora_path": "a1"})
    assert gone.status_code == 404 and "a1" in gone.json()["error"]["message"]
    gone = http.post("/v1/completions", json={"model": "a1", "prompt": "1+1="})
    assert gone.status_code == 404 and "a1" in gone.json()["error"]["message"]
    again = http.post("/unload_lora_adapter", json={"lora_name": "a1"})
    assert again.status_code == 404 and "a1" in again.json()["error_message"]
    bad = http.post("/load_lora_adapter", json={"lora_name": "a4", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and not bad.json()["success"]
    assert http.post("/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    settled(ctl, full=True)


def test_released_memory_holds_requests_until_resumed(ctl, http):
    assert http.post("/release_memory_occupation", json={}).status_code == 200
    assert settled(ctl)["memory_released"]
    t, box = in_background(
        post, http, "/generate", {"text": "1+1=", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    )
    until(lambda: running(ctl) == 1)
    time.sleep(0.2)
    assert t.is_alive()  # waits: no step runs on released pools
    assert http.post("/resume_memory_occupation", json={}).status_code == 200
    t.join(30)
    assert box["out"].status_code == 200 and len(box["out"].json()["output_ids"]) <= 4
    settled(ctl, full=True)


def test_pause_in_place_keeps_requests_in_flight_and_continue_finishes_them(ctl, http):
    posts = [
        in_background(post, http, "/generate", {"text": t, "sampling_params": LONG}) for t in ("1+1=", "2+2=", "3+3=")
    ]
    until(lambda: run_on_loop(ctl, lambda e: sum(len(r.req.output_ids) > 0 for r in e.scheduler.running)) >= 2)
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    tokens = lambda e: sum(len(r.req.output_ids) for r in e.scheduler.running)  # noqa: E731
    before = run_on_loop(ctl, tokens)
    time.sleep(0.3)
    assert run_on_loop(ctl, tokens) == before  # no step ran
    refused = http.post("/release_memory_occupation", json={})
    assert refused.status_code == 400 and "in flight" in refused.json()["error"]["message"]
    run_on_loop(ctl, lambda e: e.check_invariants())
    assert http.get("/get_server_info").json()["internal_states"][0]["paused"]
    assert http.post("/continue_generation", json={}).status_code == 200
    for t, box in posts:
        t.join(60)
        out = box["out"].json()
        assert box["out"].status_code == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(out["output_ids"]) == LONG["max_new_tokens"]
    settled(ctl, full=True)


def test_abort_one_and_all_finish_with_abort_never_a_5xx(ctl, http):
    client = openai.OpenAI(base_url=f"{ctl.url}/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=MODEL, prompt="12+7=", max_tokens=150, temperature=0, extra_body={"ignore_eos": True})
    whole = in_background(lambda: client.completions.create(**kw))
    streamed = in_background(lambda: list(client.completions.create(**kw, stream=True)))
    victim = in_background(post, http, "/generate", {"text": "1+1=", "rid": "victim", "sampling_params": LONG})
    until(lambda: running(ctl) == 3)
    assert http.post("/abort_request", json={"rid": "victim"}).status_code == 200
    victim[0].join(30)
    out = victim[1]["out"]
    assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert running(ctl) == 2
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    whole[0].join(30)
    streamed[0].join(30)
    assert "error" not in whole[1] and "error" not in streamed[1], (whole[1], streamed[1])
    assert whole[1]["out"].choices[0].finish_reason == "abort"
    assert streamed[1]["out"][-1].choices[0].finish_reason == "abort"
    settled(ctl, full=True)
    # pause with mode abort (SGLang's default) ends what runs; a request sent meanwhile waits for the continue
    first = in_background(post, http, "/generate", {"text": "1+1=", "sampling_params": LONG})
    until(lambda: running(ctl) == 1)
    assert http.post("/pause_generation", json={}).status_code == 200
    first[0].join(30)
    assert first[1]["out"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    later = in_background(
        post, http, "/generate", {"text": "2+2=", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    )
    until(lambda: running(ctl) == 1)
    assert http.post("/continue_generation", json={}).status_code == 200
    later[0].join(30)
    assert later[1]["out"].status_code == 200
    settled(ctl, full=True)


def test_weight_version_server_info_and_metrics_report_the_state(ctl, http):
    assert http.post("/update_weight_version", json={"new_version": "step-7"}).json()["new_version"] == "step-7"
    assert http.get("/get_weight_version").json() == {"weight_version": "step-7"}
    out = http.post("/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "step-7"
    assert http.get("/get_model_info").json()["weight_version"] == "step-7"
    long = "1+2+3+4+5+6+7+8+9+" * 5 + "1="  # past a chunk (64 tokens): the second one hits the cache
    for _ in range(2):
        http.post("/generate", json={"text": long, "sampling_params": {"max_new_tokens": 2}})
    info = http.get("/get_server_info").json()
    state = info["internal_states"][0]
    assert info["weight_version"] == "step-7" and info["max_total_num_tokens"] == 1360
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
    assert state["kv_pages_used"] <= state["kv_pages_total"] and 0 < state["cache_hit_rate"] < 1
    text = http.get("/metrics").text
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[0] != "#"}
    assert metrics["sglang:num_running_reqs"] == 0 and metrics["miles_k3:kv_pages_total"] == state["kv_pages_total"]
    assert metrics['miles_k3:requests_finished_total{finish_reason="abort"}'] >= 4
    assert metrics["sglang:cache_hit_rate"] == pytest.approx(state["cache_hit_rate"])


def test_a_request_too_long_for_the_pool_names_max_tokens_and_memory_mb(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 1500})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_tokens" in msg and "--memory-mb" in msg and "pages" not in msg
    r = http.post("/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 1500}})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_new_tokens" in msg and "--memory-mb" in msg and "memory_bytes" not in msg


def test_pause_retract_frees_the_pools_and_continue_finishes_as_if_never_paused(ctl, http, adapter_dir):
    """SGLang's retract pause: every request in flight is retracted (none runs; what they hold is only cache,
    so a flush brings both pools back to full, and the memory can be released and resumed meanwhile); one
    aborted while retracted finishes with abort; the adapter a retracted request uses cannot be unloaded;
    after the continue the others finish with the outputs of an unpaused run, greedy and seeded."""
    sampling = [{"temperature": 0}, {"temperature": 1.0, "sampling_seed": 7}, {"temperature": 0.8, "sampling_seed": 9}]
    bodies = [
        {"text": f"{i}+{i}=", "return_logprob": True, "sampling_params": {**LONG, **s}}
        for i, s in enumerate(sampling, 1)
    ]
    want = [post(http, "/generate", body).json() for body in bodies]  # unpaused, one at a time
    settled(ctl, full=True)
    retractions = run_on_loop(ctl, lambda e: e.counters()["retractions"])
    assert http.post("/load_lora_adapter", json={"lora_name": "held", "lora_path": str(adapter_dir)}).status_code == 200
    posts = [in_background(post, http, "/generate", body) for body in bodies]
    victim = in_background(post, http, "/generate", {"text": "4+4=", "rid": "parked", "sampling_params": LONG})
    held = in_background(post, http, "/generate", {"text": "5+5=", "lora_path": "held", "sampling_params": LONG})
    until(lambda: run_on_loop(ctl, lambda e: sum(len(r.req.output_ids) > 0 for r in e.scheduler.running)) == 5)
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    pools = run_on_loop(ctl, lambda e: e.pool_stats())
    assert pools["running"] == pools["waiting"] == 0  # out of the engine, held by the server
    assert (pools["kv_pages_used"], pools["kda_slots_used"]) == (pools["tree_pages"], pools["tree_slots"])
    state = http.get("/get_server_info").json()["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 5 and state["paused"]
    refused = http.post("/unload_lora_adapter", json={"lora_name": "held"})
    assert refused.status_code == 400 and "retracted" in refused.json()["error_message"]
    run_on_loop(ctl, lambda e: e.check_invariants())
    assert http.post("/flush_cache").status_code == 200
    state = http.get("/get_server_info").json()["internal_states"][0]
    assert state["kv_pages_used"] == 0 and state["kda_slots_used"] == 0 and state["kv_pages_total"] > 0
    assert http.post("/release_memory_occupation", json={}).status_code == 200
    assert http.post("/resume_memory_occupation", json={}).status_code == 200
    assert http.post("/abort_request", json={"rid": "parked"}).status_code == 200
    victim[0].join(30)
    assert victim[1]["out"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    time.sleep(0.2)
    assert all(t.is_alive() for t, _ in posts)  # no step ran
    assert http.post("/continue_generation", json={}).status_code == 200
    held[0].join(60)
    assert held[1]["out"].status_code == 200 and len(held[1]["out"].json()["output_ids"]) == LONG["max_new_tokens"]
    assert http.post("/unload_lora_adapter", json={"lora_name": "held"}).status_code == 200
    for (t, box), w in zip(posts, want):
        t.join(60)
        out = box["out"].json()
        assert box["out"].status_code == 200 and out["output_ids"] == w["output_ids"]
        got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx([e[0] for e in w["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert run_on_loop(ctl, lambda e: e.counters()["retractions"]) >= retractions + 3
    settled(ctl, full=True)
