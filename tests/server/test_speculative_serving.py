"""miles-serve with `--speculative dspark --drafter DIR`: greedy answers through the real `openai` client equal
a server without speculation, token for token (log-probs within 1e-4), streamed or not, top / given-id /
prompt log-probs included once the server stops refusing them; bad speculation flags stop the server with one
line naming the flag."""

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


def assert_close_meta(got, want) -> None:
    """SGLang meta_info values (triples [log-prob, id, text], lists of them, None) equal: ids and texts exact,
    log-probs within 1e-4."""
    if isinstance(want, list) and len(want) == 3 and isinstance(want[1], int) and not isinstance(want[0], list):
        assert got[1:] == want[1:]
        assert got[0] == pytest.approx(want[0], abs=1e-4)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_close_meta(g, w)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4)
    else:
        assert got == want


def test_top_logprobs_under_speculation_equal_the_plain_servers(clients):
    """OpenAI `logprobs=N` (completions), chat `top_logprobs` (streamed too) and SGLang `top_logprobs_num`,
    `token_ids_logprob` and `logprob_start_len` answer under speculation as without it: tokens and top ids
    exact, log-probs within 1e-4."""
    plain, spec = clients
    for text in PROMPTS[:2]:
        want, got = (
            c.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0, logprobs=3).choices[0]
            for c in (plain, spec)
        )
        assert (got.text, got.logprobs.tokens) == (want.text, want.logprobs.tokens)
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
        for g, w in zip(got.logprobs.top_logprobs, want.logprobs.top_logprobs, strict=True):
            assert list(g) == list(w) and list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)
    messages = [{"role": "user", "content": "45+45="}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    want = [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in (plain.chat.completions.create(**kw).choices[0].logprobs.content)
    ]
    streamed = [
        e
        for c in spec.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    got = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in streamed]
    assert [(t, [a for a, _ in top]) for t, _, top in got] == [(t, [a for a, _ in top]) for t, _, top in want]
    assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
    assert [v for *_, top in got for _, v in top] == pytest.approx([v for *_, top in want for _, v in top], abs=1e-4)
    urls = [str(c.base_url).removesuffix("/v1/") for c in (plain, spec)]
    body = {
        "text": "12+3=",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "token_ids_logprob": [5, 7],
        "logprob_start_len": 0,
    }
    metas = []
    for url in urls:
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        metas.append(r.json()["meta_info"])
    want, got = metas
    for key in (
        "output_token_logprobs",
        "output_top_logprobs",
        "output_token_ids_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "input_token_ids_logprobs",
    ):
        assert key in want, key
        assert_close_meta(got[key], want[key])
