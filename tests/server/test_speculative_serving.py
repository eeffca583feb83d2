"""miles-serve with `--speculative dspark --drafter DIR`: greedy answers through the real `openai` client equal
a server without speculation, token for token (log-probs within 1e-4), streamed or not; bad speculation
flags stop the server with one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from miles_k3.model import K3Config
from miles_k3.model.assets import builtin_path
from rollout.spec.drafter import DSparkConfig, DSparkDrafter
from tests.server.common import MODEL, config, serve
from tests.server.test_cli import run_main

PROMPTS = ["12+3=", "7-9=", "45+45=", "99-1="]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A random-init DSpark drafter for the embedded base (its acceptance is whatever it is: losslessness
    does not depend on it), saved as scripts/train_drafter.py saves one."""
    target = K3Config.from_json_file(Path(builtin_path(MODEL)) / "config.json")
    torch.manual_seed(0)
    d = DSparkDrafter(
        DSparkConfig(
            target_layers=(0, target.num_hidden_layers - 1),
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            block_size=3,
            context_window=16,
        )
    )
    path = tmp_path_factory.mktemp("drafter")
    d.save(path)
    return path


@pytest.fixture(scope="module")
def clients(drafter_dir):
    plain = serve(config())
    spec = serve(config(speculative="dspark", drafter=str(drafter_dir), gamma=3))
    try:
        yield tuple(
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60) for s in (plain, spec)
        )
    finally:
        plain.stop()
        spec.stop()


def test_speculative_greedy_completions_equal_plain_ones(clients):
    plain, spec = clients
    for text in PROMPTS:
        want = plain.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0, logprobs=0)
        got = spec.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0, logprobs=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            want.choices[0].logprobs.token_logprobs, abs=1e-4
        )


def test_a_speculative_stream_carries_the_same_text(clients):
    plain, spec = clients
    messages = [{"role": "user", "content": "45+45="}]
    want = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--speculative", "eagle", "--drafter", "x"], "--speculative must be one of"),
        (["--speculative", "dspark"], "--speculative dspark and --drafter go together"),
        (["--drafter", "DRAFTER"], "--speculative dspark and --drafter go together"),
        (["--speculative", "dspark", "--drafter", "/nonexistent"], "--drafter /nonexistent: no drafter here"),
        (["--speculative", "dspark", "--drafter", "DRAFTER", "--gamma", "0"], "--gamma must be an integer >= 1"),
        (["--speculative", "dspark", "--drafter", "DRAFTER", "--spec-planner", "psychic"], "--spec-planner must be"),
        (
            ["--speculative", "dspark", "--drafter", "DRAFTER", "--spec-max-batch", "0"],
            "--spec-max-batch must be an integer >= 1",
        ),
    ],
)
def test_bad_speculation_flags_stop_the_server_with_one_line(flags, match, drafter_dir):
    flags = [str(drafter_dir) if f == "DRAFTER" else f for f in flags]
    code, err = run_main("--model", MODEL, "--port", "0", *flags)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err


def test_top_logprobs_under_speculation_are_a_400_naming_the_field(clients):
    """The verify step computes no alternatives: asking for top, given-id or prompt log-probs is a 400 naming
    the field it came in (the sampled tokens' own log-probs are served, as above)."""
    plain, spec = clients
    with pytest.raises(openai.BadRequestError) as e:
        spec.completions.create(model=MODEL, prompt="12+3=", max_tokens=4, temperature=0, logprobs=3)
    assert e.value.body["param"] == "logprobs" and "--speculative" in e.value.body["message"]
    messages = [{"role": "user", "content": "1+1="}]
    with pytest.raises(openai.BadRequestError) as e:
        spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    url = str(spec.base_url).removesuffix("/v1/")
    for key, value in (("top_logprobs_num", 2), ("token_ids_logprob", [5]), ("logprob_start_len", 0)):
        r = httpx.post(f"{url}/generate", json={"text": "1+1=", "return_logprob": True, key: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text
    ok = httpx.post(f"{url}/generate", json={"text": "1+1=", "return_logprob": True, "logprob_start_len": -1})
    assert ok.status_code == 200 and ok.json()["meta_info"]["output_token_logprobs"]
    assert plain.completions.create(model=MODEL, prompt="12+3=", max_tokens=2, logprobs=3).choices[0].logprobs
