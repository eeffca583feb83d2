"""SGLang's native API over plain HTTP (httpx): /generate with text or input_ids, return_logprob laid out as
SGLang lays it out, streaming, batches, n, the adapter by lora_path; /health, /get_model_info,
/abort_request. Greedy outputs and log-probs equal the in-process engine's."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from rollout.request import SamplingParams
from tests.server.common import ADAPTER, MODEL, wait_idle

TEXTS = ["12+3=", "7-9=", "45+45=", "8+1="]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE stream; asserts it ends with [DONE]."""
    lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_greedy_outputs_equal_the_in_process_engine(http, reference):
    tok = reference.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(tok.eos_token_id,))
    want = reference.engine.generate(prompts, params)
    r = http.post(
        "/generate",
        json={"input_ids": prompts, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
    )
    assert r.status_code == 200
    outs = r.json()
    assert len(outs) == len(prompts)
    for out, w in zip(outs, want):
        meta = out["meta_info"]
        assert out["output_ids"] == w.output_ids
        assert [item[1] for item in meta["output_token_logprobs"]] == w.output_ids
        assert [item[0] for item in meta["output_token_logprobs"]] == pytest.approx(w.logprobs, abs=1e-4)
        assert out["text"] == tok.decode(w.output_ids)
        assert meta["prompt_tokens"] == len(w.prompt_ids) and meta["completion_tokens"] == len(w.output_ids)
        if w.finish_reason.value == "stop":
            assert meta["finish_reason"] == {"type": "stop", "matched": tok.eos_token_id}
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 8}


def test_text_prompt_single_answer_and_logprob_text(http):
    r = http.post(
        "/generate",
        json={
            "text": "12+3=",
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        },
    )
    out = r.json()
    assert isinstance(out, dict) and len(out["output_ids"]) == 4
    assert "".join(item[2] for item in out["meta_info"]["output_token_logprobs"]) == out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    no_lp = http.post("/generate", json={"text": "12+3=", "sampling_params": {"max_new_tokens": 2}}).json()
    assert "output_token_logprobs" not in no_lp["meta_info"]


def test_stream_events_grow_to_the_whole_answer(http):
    body = {
        "text": "45+45=",
        "return_logprob": True,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
    }
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        evs = events(r)
    whole = http.post("/generate", json={**body, "stream": False}).json()
    assert len(evs) == 6  # one event per token (stream_interval 1)
    assert [len(e["output_ids"]) for e in evs] == [1, 2, 3, 4, 5, 6]
    assert evs[-1]["text"] == whole["text"] and evs[-1]["output_ids"] == whole["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in evs[:-1]] == [None] * 5
    assert evs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    lps = [item[0] for item in evs[-1]["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx([item[0] for item in whole["meta_info"]["output_token_logprobs"]], abs=1e-5)
    body["sampling_params"]["stream_interval"] = 4
    with http.stream("POST", "/generate", json=body) as r:
        assert [len(e["output_ids"]) for e in events(r)] == [4, 6]


def test_n_samples_seeded_and_indexed(http):
    body = {"text": "3+4=", "sampling_params": {"n": 3, "temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 11}}
    a, b = http.post("/generate", json=body).json(), http.post("/generate", json=body).json()
    assert len(a) == 3 and [x["text"] for x in a] == [x["text"] for x in b]
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        evs = events(r)
    assert {e["index"] for e in evs} == {0, 1, 2}
    last = {e["index"]: e for e in evs}
    assert [last[i]["text"] for i in range(3)] == [x["text"] for x in a]


def test_lora_path_selects_the_adapter(http, reference):
    tok = reference.tokenizer
    ids = tok.encode("12+3=")
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    want = reference.engine.generate([ids], params, adapter=ADAPTER)[0]
    out = http.post(
        "/generate",
        json={"input_ids": ids, "lora_path": ADAPTER, "sampling_params": {"temperature": 0, "max_new_tokens": 6}},
    ).json()
    assert out["output_ids"] == want.output_ids


def test_abort_request_ends_a_request_with_what_it_had(http, server):
    result = {}

    def long_request():
        with httpx.Client(base_url=server.url, timeout=60) as c:
            result["out"] = c.post(
                "/generate",
                json={
                    "text": "1+1=",
                    "rid": "long-one",
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                },
            ).json()

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.5)
    assert http.post("/abort_request", json={"rid": "long-one"}).status_code == 200
    t.join(30)
    out = result["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "long-one"
    assert len(out["output_ids"]) < 200
    wait_idle(server)


def test_health_and_model_info(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["served_model_name"] == MODEL
    assert info["lora_adapters"] == [ADAPTER] and info["model_path"].endswith("k3-tiny-arith")
