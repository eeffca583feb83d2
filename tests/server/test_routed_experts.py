"""`/generate` with `return_routed_experts` (a server started with --record-routing): every fed token's experts,
encoded as SGLang encodes them, equal to the reference routers' choice over the same tokens; refused by a
server that does not record."""

import httpx
import pytest
import torch

from miles_k3.model.routing import Routing, decode_table, moe_layers
from tests.server.common import config, run_on_loop, serve


@pytest.fixture(scope="module")
def server():
    s = serve(config(record_routing=True))
    yield s
    s.stop()


def test_generate_returns_every_fed_tokens_experts(server):
    body = {"text": "12+7=", "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "return_routed_experts": True}
    out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    model = run_on_loop(server, lambda e: e.model)
    c = model.config
    fed = out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"] - 1
    table = decode_table(out["meta_info"]["routed_experts"], len(moe_layers(c)), c.num_experts_per_token)
    assert table.shape[0] == fed
    tokens = _prompt_ids(server, "12+7=") + out["output_ids"]
    routing = Routing.of(model, c)

    def reference(engine):  # on the engine's thread, between its steps: the same model, one plain forward
        with torch.inference_mode(), routing.recording():
            engine.model(torch.tensor([tokens[:-1]]))
            return routing.table(len(tokens) - 1)

    want = run_on_loop(server, reference)
    assert torch.equal(table.long().sort(-1).values, want.long().sort(-1).values)


def test_a_server_that_does_not_record_refuses_the_field():
    s = serve(config())
    try:
        r = httpx.post(f"{s.url}/generate", json={"text": "1+1=", "return_routed_experts": True}, timeout=60)
        assert r.status_code == 400 and "--record-routing" in r.text
    finally:
        s.stop()


def _prompt_ids(server, text: str) -> list[int]:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    return [t for _, t, _ in out["meta_info"]["input_token_logprobs"]]


def test_the_record_routing_flag_reaches_the_engine_config():
    from rollout.server.__main__ import parse_config

    on, off = (
        parse_config(["--model", "builtin:k3-tiny-arith", "--record-routing"]),
        parse_config(["--model", "builtin:k3-tiny-arith"]),
    )
    assert on.record_routing and on.engine_overrides()["record_routing"] is True
    assert not off.record_routing and "record_routing" not in off.engine_overrides()
