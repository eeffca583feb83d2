"""miles-serve as a user runs it: `python -m rollout.server` in a subprocess serves, finishes an in-flight
stream on SIGTERM and exits 0; bad flags stop it with one line naming the flag (exit 2); `--model DIR`
serves an HF checkpoint through its own tokenizer and chat template."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from rollout.server.__main__ import main
from tests.server.common import config, serve

REPO = Path(__file__).resolve().parents[2]


def run_main(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, err.getvalue()


def test_sigterm_finishes_in_flight_streams_aborts_the_rest_at_the_deadline_and_exits_0():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout.server",
            "--model",
            "builtin:k3-tiny-arith",
            "--port",
            "0",
            "--quantize",
            "none",
            "--shutdown-timeout",
            "3",
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    streams = {"short": 10, "long": 3000}  # the short one ends within the timeout, the long one cannot
    got: dict[str, list[str]] = {name: [] for name in streams}
    started = {name: threading.Event() for name in streams}
    try:
        line = proc.stdout.readline()
        assert line.startswith("miles-serve: serving builtin:k3-tiny-arith"), line + proc.stderr.read()
        url = line.rsplit(" ", 1)[-1].strip()

        def stream(name: str) -> None:
            body = {
                "text": "1+1=",
                "stream": True,
                "sampling_params": {"max_new_tokens": streams[name], "ignore_eos": True},
            }
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
                for data in r.iter_lines():
                    if data.startswith("data: "):
                        got[name].append(data[6:])
                        started[name].set()

        threads = [threading.Thread(target=stream, args=(name,)) for name in streams]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        assert proc.stdout.read().strip() == "miles-serve: stopped"
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    short, long = (json.loads(got[name][-2]) for name in streams)
    assert got["short"][-1] == "[DONE]" and len(short["output_ids"]) == 10  # finished, not cut
    assert short["meta_info"]["finish_reason"]["type"] == "length"
    assert got["long"][-1] == "[DONE]" and long["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(long["output_ids"]) < 3000


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--model", "/no/such/dir"], "--model must be a directory holding config.json"),
        (["--model", "builtin:nope"], "--model names no embedded model"),
        (["--model", "builtin:k3-tiny-arith", "--max-queued", "-1"], "--max-queued must be an integer >= 0"),
        (["--model", "builtin:k3-tiny-arith", "--dtype", "float16"], "--dtype must be one of"),
        (["--model", "builtin:k3-tiny-arith", "--adapter", "x=/no/such/adapter"], "--adapter x=/no/such/adapter"),
        (["--model", "builtin:k3-tiny-arith", "--adapter", "noequals"], "expected NAME=PEFT_DIR"),
        (["--model", "builtin:k3-tiny-arith", "--max-running", "0"], "--max-running must be an integer >= 1"),
    ],
)
def test_bad_flags_stop_it_with_one_line(argv, fragment):
    code, err = run_main(*argv)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"miles-serve: error: {err.split('error: ', 1)[1].strip()}"]
    assert fragment in err


def test_an_adapter_that_is_not_peft_is_named(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    code, err = run_main("--model", "builtin:k3-tiny-arith", "--adapter", f"bad={tmp_path}")
    assert code == 2 and f"--adapter bad={tmp_path}" in err and "Traceback" not in err, err


# ------------------------------------------------------------------ an HF checkpoint
WORDS = "0 1 2 3 4 5 6 7 8 9 + - = ?".split()
TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"


def write_hf_checkpoint(path: Path) -> Path:
    """A random-init k3-tiny over a word-level tokenizer (saved by transformers) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from miles_k3.model import K3Config, K3ForCausalLM

    vocab = {
        "<pad>": 0,
        "<bos>": 1,
        "<eos>": 2,
        "<unk>": 3,
        "user": 4,
        "assistant": 5,
        "system": 6,
        ":": 7,
        **{w: i + 8 for i, w in enumerate(WORDS)},
    }
    torch.manual_seed(0)
    K3ForCausalLM(
        K3Config.from_preset("k3-tiny", vocab_size=len(vocab), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=TEMPLATE,
    ).save_pretrained(path)
    return path


def test_an_hf_checkpoint_is_served_with_its_own_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    path = write_hf_checkpoint(tmp_path / "ckpt")
    hf = AutoTokenizer.from_pretrained(path)
    server = serve(config(model=str(path)))
    try:
        messages = [{"role": "system", "content": "="}, {"role": "user", "content": "1 + 2 ="}]
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            timeout=60,
            json={"model": str(path), "messages": messages, "max_tokens": 5, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        want = hf.encode(
            hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        g = httpx.post(
            f"{server.url}/generate",
            timeout=60,
            json={"input_ids": want, "sampling_params": {"temperature": 0, "max_new_tokens": 5}},
        ).json()
        assert g["text"] == r.json()["choices"][0]["message"]["content"]
        assert g["text"] == hf.decode(g["output_ids"], skip_special_tokens=True)
        c = httpx.post(
            f"{server.url}/generate", timeout=60, json={"text": "3 + 4 =", "sampling_params": {"max_new_tokens": 1}}
        ).json()
        assert c["meta_info"]["prompt_tokens"] == len(hf.encode("3 + 4 =", add_special_tokens=True))
    finally:
        server.stop()


def _served_generation(*flags: str) -> tuple[list, list, int]:
    """Start `python -m rollout.server` with `flags`, generate greedily from two prompts over /generate, stop it
    with SIGTERM; (output ids, log-probs, exit status)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.server", "--model", "builtin:k3-tiny-arith", "--port", "0"]
        + ["--quantize", "none", "--log-level", "warning", *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("miles-serve: serving builtin:k3-tiny-arith"), line + proc.stderr.read()
        url = line.rsplit(" ", 1)[-1].strip()
        ids, logprobs = [], []
        for text in ("12+7=", "3*4="):
            body = {"text": text, "return_logprob": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
            out = httpx.post(f"{url}/generate", json=body, timeout=120).json()
            ids.append(out["output_ids"])
            logprobs.append([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    return ids, logprobs, code


def test_tp2_serves_one_engine_over_two_ranks_with_the_one_rank_outputs_and_stops_whole_on_sigterm():
    """`--tp 2` spawns two engine ranks (rank 0 serves, rank 1 replays its calls): greedy outputs are one rank's
    and log-probs agree to fp32 reduction order; SIGTERM to the command stops both ranks and exits 0."""
    one_ids, one_lps, code1 = _served_generation()
    two_ids, two_lps, code2 = _served_generation("--tp", "2")
    assert (code1, code2) == (0, 0)
    assert two_ids == one_ids
    for a, b in zip(one_lps, two_lps):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_tp_flags_are_checked_before_any_rank_starts():
    code, err = run_main("--model", "builtin:k3-tiny-arith", "--tp", "3", "--dcp", "2")
    assert code == 2 and err.strip() == (
        "miles-serve: error: --dcp 2 must divide --tp 3: decode context parallelism runs inside the tensor-parallel "
        "group"
    )
