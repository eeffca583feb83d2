"""The malformed-request list: each gets a 4xx with a JSON error naming what is wrong, never a 5xx, and the
server goes on serving."""

from __future__ import annotations

import httpx
import pytest

from tests.server.common import ADAPTER, MODEL

CHAT = [{"role": "user", "content": "1+1="}]

# (method, path, body: dict = JSON, bytes = raw; expected status, a fragment of the message)
CASES = [
    ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("POST", "/v1/completions", {"prompt": "1+1="}, 400, "model is required"),
    ("POST", "/v1/completions", {"model": MODEL}, 400, "prompt is required"),
    ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "1+1="}, 404, "does not exist"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "top_p": 1.5}, 400, "top_p"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "max_tokens": 5000}, 400, "max_seq_len"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "n": 0}, 400, "n must be >= 1"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "n": 10**4}, 400, "samples"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 999]}, 400, "not a token id"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hello"}, 400, "arithmetic vocabulary"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "temprature": 0.5}, 400, "unknown field"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "logprobs": 21}, 400, "logprobs must be <= 20"),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "top_logprobs": 2},
        400,
        "top_logprobs needs logprobs",
    ),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "seed": -1}, 400, "seed"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "stop": [""]}, 400, "stop"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "frequency_penalty": 0.5}, 400, "not supported"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "1+1=", "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "content"),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]},
        400,
        "not supported",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "stream_options": {"bogus": 1}},
        400,
        "stream_options.bogus",
    ),
    ("POST", "/generate", {"text": "1+1=", "input_ids": [1, 4]}, 400, "exactly one of text and input_ids"),
    ("POST", "/generate", {}, 400, "exactly one of text and input_ids"),
    ("POST", "/generate", {"input_ids": []}, 400, "input_ids"),
    ("POST", "/generate", {"text": "1+1=", "sampling_params": {"top_k": 0}}, 400, "sampling_params.top_k"),
    (
        "POST",
        "/generate",
        {"text": "1+1=", "sampling_params": {"max_new_token": 3}},
        400,
        "unknown field 'sampling_params.max_new_token'",
    ),
    ("POST", "/generate", {"text": "1+1=", "sampling_params": {"regex": "[0-9]+"}}, 400, "not supported"),
    ("POST", "/generate", {"text": "1+1=", "lora_path": "nope"}, 404, "does not exist"),
    ("POST", "/generate", {"text": ["1+1=", "2+2="], "sampling_params": [{}]}, 400, "1 entries for 2 prompts"),
    ("POST", "/generate", {"text": "1+1=", "return_logprob": "yes"}, 400, "return_logprob"),
    ("POST", "/generate", {"text": "1+1=", "top_logprobs_num": -1}, 400, "top_logprobs_num"),
    ("POST", "/generate", {"text": "1+1=", "return_logprob": True, "logprob_start_len": 50}, 400, "logprob_start_len"),
    ("POST", "/generate", {"text": "1+1=", "token_ids_logprob": [10**6]}, 400, "token_ids_logprob"),
    ("POST", "/abort_request", {}, 400, "rid or abort_all"),
    ("POST", "/generate", b" " * (33 << 20), 413, "over 32 MiB"),
    ("GET", "/v1/completions", None, 405, "Method Not Allowed"),
    ("GET", "/no/such/route", None, 404, "Not Found"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize(
    "method, path, body, status, fragment", CASES, ids=[f"{i:02d}-{c[1]}-{c[4][:24]}" for i, c in enumerate(CASES)]
)
def test_a_malformed_request_gets_a_4xx_json_error(http, method, path, body, status, fragment):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = http.request(method, path, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and "Traceback" not in error["message"]
    assert http.get("/health").status_code == 200


def test_the_server_serves_after_all_of_them(http):
    r = http.post("/v1/completions", json={"model": ADAPTER, "prompt": "1+1=", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
