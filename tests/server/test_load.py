"""Under load and misbehaving clients: hundreds of concurrent requests on loopback with random aborts and
disconnects are each answered or cleanly refused (429), and afterwards the engine's pools are full again;
a client that disconnects mid-stream or while waiting aborts its request at once."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.rollout.common import assert_pools_drain_to_full
from tests.server.common import MODEL, config, run_on_loop, serve, wait_idle

REQUESTS = 300


@pytest.fixture(scope="module")
def small():
    """A small server: 8 decode slots and 16 waiting samples, so 300 concurrent requests overload it."""
    s = serve(config(max_running=8, max_queued=16))
    yield s
    s.stop()


async def _client(c: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """A client that retries a 429 a few times after a pause, as real ones do."""
    for _ in range(4):
        outcome = await _client_request(c, rng, i)
        if outcome != "refused":
            return outcome
        await asyncio.sleep(rng.uniform(0.05, 0.5))
    return outcome


async def _client_request(c: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """One random request: plain or streaming, /generate or /v1/completions, n of 1 or 2; a third of them
    give up early (a timeout that closes the connection, or leaving a stream after its first event)."""
    stream, openai_api = rng.random() < 0.5, rng.random() < 0.5
    behaviour = rng.choice(["wait", "wait", "give_up"])
    n = rng.choice([1, 1, 2])
    tokens = rng.randint(1, 12)
    if openai_api:
        url, body = (
            "/v1/completions",
            {"model": MODEL, "prompt": f"{i}+{i % 7}=", "max_tokens": tokens, "n": n, "stream": stream},
        )
    else:
        url, body = (
            "/generate",
            {"text": f"{i}-{i % 5}=", "stream": stream, "sampling_params": {"max_new_tokens": tokens, "n": n}},
        )
    try:
        if not stream:
            timeout = rng.uniform(0.01, 0.3) if behaviour == "give_up" else 120
            r = await c.post(url, json=body, timeout=timeout)
            if r.status_code == 429:
                assert r.json()["error"]["message"].startswith("server busy")
                return "refused"
            assert r.status_code == 200, r.text
            out = r.json()
            assert (len(out["choices"]) if openai_api else (len(out) if n > 1 else 1)) == n
            return "answered"
        async with c.stream("POST", url, json=body, timeout=120) as r:
            if r.status_code == 429:
                return "refused"
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if behaviour == "give_up":
                        return "gave_up"
            assert lines[-1] == "[DONE]"
            assert all("error" not in json.loads(x) for x in lines[:-1])
            return "answered"
    except httpx.TimeoutException:
        return "gave_up"


def test_hundreds_of_concurrent_requests_with_aborts_leave_the_pools_full(small):
    async def main():
        rng = random.Random(0)
        limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=small.url, limits=limits) as c:
            return await asyncio.gather(*[_client(c, random.Random(rng.random()), i) for i in range(REQUESTS)])

    outcomes = asyncio.run(main())
    counts = {k: outcomes.count(k) for k in ("answered", "refused", "gave_up")}
    assert sum(counts.values()) == REQUESTS, counts
    assert min(counts.values()) >= 5, counts  # every kind of outcome happened
    wait_idle(small)
    run_on_loop(small, assert_pools_drain_to_full)
    # and it still serves
    r = httpx.post(f"{small.url}/generate", json={"text": "1+2=", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200


def test_a_client_leaving_mid_stream_aborts_its_request(small):
    body = {"text": "1+1=", "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with httpx.Client(base_url=small.url, timeout=60) as c:
        with c.stream("POST", "/generate", json=body) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert len(json.loads(first[6:])["output_ids"]) < 200
    wait_idle(small, timeout=5)  # 200 tokens would take far longer: the disconnect aborted it
    run_on_loop(small, assert_pools_drain_to_full)


def test_a_client_leaving_while_waiting_aborts_its_request(small):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{small.url}/v1/completions",
            timeout=0.3,
            json={"model": MODEL, "prompt": "1+1=", "max_tokens": 200, "ignore_eos": True},
        )
    wait_idle(small, timeout=5)
    run_on_loop(small, assert_pools_drain_to_full)
