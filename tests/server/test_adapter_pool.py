"""miles-serve's adapter pool shaped by flags (`--max-loras`, `--max-lora-rank`, `--lora-target-modules`), so
adapters load at runtime into a server started without any: an adapter of the pool's rank over the pool's
modules serves exactly what an engine built with it serves; one of a lower rank, zero-padded into its slot,
the same tokens (log-probs to float rounding: the padded rank changes the GEMMs' reduction length); a
higher rank, modules outside the pool, a full pool or no pool at all is a 400 naming the flag. Bad pool
flags stop the server with one line naming the flag."""

from __future__ import annotations

import threading

import httpx
import pytest

from rollout.request import SamplingParams
from rollout.server.app import Server
from rollout.server.loading import Served
from tests.server.common import ADAPTER, MODEL, config, run_on_loop, serve, twin, wait_idle, write_adapter
from tests.server.test_cli import run_main

Q_PROJ = r"self_attn\.q_proj$"
# greedy and seeded sampling: the pool must not change a sample
SAMPLING = [
    {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
    {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 11},
]
TEXTS = ["12+7=", "45-9="]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("pool_adapters")
    return {
        "rank2": write_adapter(d / "rank2", seed=1, rank=2),
        "rank8": write_adapter(d / "rank8", seed=2, rank=8, targets=(Q_PROJ,)),
        "q": write_adapter(d / "q", seed=3, rank=4, targets=(Q_PROJ,)),
    }


def _server(cfg):
    s = serve(cfg)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pooled():
    """No adapter at start: two slots of rank 8 over every adaptable module."""
    yield from _server(config(max_lora_rank=8, max_loras=2))


@pytest.fixture(scope="module")
def narrow():
    """No adapter at start: one slot of rank 4 over the attention q projections only."""
    yield from _server(config(max_lora_rank=4, lora_target_modules=(Q_PROJ,)))


def generate(server: Server, text: str, adapter: str | None, sampling: dict) -> tuple[list[int], list[float]]:
    body = {"text": text, "return_logprob": True, "sampling_params": sampling}
    if adapter is not None:
        body["lora_path"] = adapter
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def expected(ref: Served, text: str, adapter: str, sampling: dict):
    params = SamplingParams(
        temperature=sampling["temperature"],
        max_new_tokens=sampling["max_new_tokens"],
        seed=sampling.get("sampling_seed"),
    )
    return ref.engine.generate([ref.tokenizer.encode(text)], params, adapter=adapter)[0]


def load(server: Server, name: str, path) -> httpx.Response:
    return httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def test_lower_ranks_load_at_runtime_and_serve_what_an_engine_built_with_them_serves(
    pooled, adapters, adapter_dir, reference
):
    """The session adapter (rank 4) and a rank-2 one, side by side in a rank-8 pool over every module; each
    request alone, then all of them (and the base) in one batch."""
    ref2 = twin(config(adapters=(("r2", str(adapters["rank2"])),)))
    assert load(pooled, "a4", adapter_dir).json()["success"]
    assert load(pooled, "a2", adapters["rank2"]).json()["success"]
    served = (("a4", reference, ADAPTER), ("a2", ref2, "r2"))  # (name here, its reference, name there)
    cases = [(text, s, name, ref, ref_name) for text in TEXTS for s in SAMPLING for name, ref, ref_name in served]
    for text, sampling, name, ref, ref_name in cases:
        want = expected(ref, text, ref_name, sampling)
        ids, logprobs = generate(pooled, text, name, sampling)
        assert ids == want.output_ids, (text, sampling, name)
        assert logprobs == pytest.approx(want.logprobs, abs=1e-4)
    # every case at once: rows of both adapters and of the base share the steps (a mixed batch)
    results: dict[int, tuple] = {}
    batch = cases + [(TEXTS[0], SAMPLING[0], None, reference, None)]

    def run(i: int) -> None:
        text, sampling, name = batch[i][:3]
        results[i] = generate(pooled, text, name, sampling)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (text, sampling, _, ref, ref_name) in enumerate(batch):
        want = expected(ref, text, ref_name, sampling)
        assert results[i][0] == want.output_ids and results[i][1] == pytest.approx(want.logprobs, abs=1e-4)
    full = load(pooled, "a5", adapter_dir)
    assert full.status_code == 400 and "--max-loras" in full.json()["error_message"]
    wait_idle(pooled)
    run_on_loop(pooled, lambda e: e.check_invariants())


def test_an_adapter_of_the_pools_shape_serves_exactly_the_built_engines_output(narrow, adapters):
    ref = twin(config(adapters=(("q", str(adapters["q"])),)))
    assert load(narrow, "q", adapters["q"]).json()["loaded_adapters"] == {"q": str(adapters["q"])}
    for text in TEXTS:
        for sampling in SAMPLING:
            want = expected(ref, text, "q", sampling)
            assert generate(narrow, text, "q", sampling) == (want.output_ids, want.logprobs)  # bit for bit
    assert httpx.post(f"{narrow.url}/unload_lora_adapter", json={"lora_name": "q"}).status_code == 200


@pytest.mark.parametrize(
    "adapter, flag",
    [("rank8", "--max-lora-rank"), ("session", "--lora-target-modules"), ("full", "--max-loras")],
)
def test_what_the_pool_cannot_take_is_a_400_naming_the_flag(narrow, adapters, adapter_dir, adapter, flag):
    if adapter == "full":  # its one slot taken
        assert load(narrow, "q", adapters["q"]).status_code == 200
    try:
        r = load(narrow, "x", adapter_dir if adapter in ("session", "full") else adapters[adapter])
        body = r.json()
        assert r.status_code == 400 and not body["success"] and flag in body["error_message"], body
        assert body["error"]["param"] == "lora_name" and "x" not in body["loaded_adapters"]
    finally:
        httpx.post(f"{narrow.url}/unload_lora_adapter", json={"lora_name": "q"})
    assert run_on_loop(narrow, lambda e: dict(e.adapters.names)) == {}  # nothing half-loaded


def test_a_server_without_a_pool_says_which_flag_gives_one(adapter_dir):
    plain = serve(config())
    try:
        r = load(plain, "x", adapter_dir)
        assert r.status_code == 400 and "--max-lora-rank" in r.json()["error_message"]
    finally:
        plain.stop()


def test_adapters_given_at_start_load_into_the_flags_pool(adapters, adapter_dir):
    """--adapter with --max-lora-rank: loaded after the build, padded like a runtime load; more slots free. In
    bfloat16 (a GPU server's default dtype): the adapters' float32 tensors are cast into the pool's dtype."""
    both = (("a2", str(adapters["rank2"])), (ADAPTER, str(adapter_dir)))
    s = serve(config(adapters=both, max_lora_rank=8, max_loras=3, dtype="bfloat16"))
    try:
        models = [m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]]
        assert models == [MODEL, "a2", ADAPTER]
        info = httpx.get(f"{s.url}/get_server_info").json()
        assert (info["enable_lora"], info["max_lora_rank"], info["max_loras_per_batch"]) == (True, 8, 3)
        assert load(s, "q", adapters["q"]).status_code == 200
        for name in ("a2", ADAPTER, "q"):
            assert len(generate(s, TEXTS[0], name, SAMPLING[0])[0]) == SAMPLING[0]["max_new_tokens"]
    finally:
        s.stop()


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--max-loras", "2"], "--max-loras 2 needs --max-lora-rank"),
        (["--max-lora-rank", "0"], "--max-lora-rank must be an integer >= 1"),
        (["--lora-target-modules", "q_proj"], "--lora-target-modules needs --max-lora-rank"),
        (["--max-lora-rank", "4", "--lora-target-modules", "no_such_proj"], "--lora-target-modules 'no_such_proj'"),
        (["--max-lora-rank", "4", "--lora-target-modules", "q_proj("], "--lora-target-modules 'q_proj(': not a regex"),
        (["--max-lora-rank", "2", "--adapter", "p=ADAPTER"], "--max-lora-rank"),
        (
            ["--max-lora-rank", "4", "--lora-target-modules", "o_proj", "--adapter", "p=ADAPTER"],
            "(--lora-target-modules)",
        ),
        (["--max-loras-per-batch", "1", "--adapter", "p=ADAPTER", "--adapter", "q=ADAPTER"], "--max-loras must hold"),
    ],
)
def test_bad_pool_flags_stop_the_server_with_one_line(flags, match, adapter_dir):
    flags = [f.replace("ADAPTER", str(adapter_dir)) for f in flags]
    code, err = run_main("--model", MODEL, "--port", "0", *flags)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
