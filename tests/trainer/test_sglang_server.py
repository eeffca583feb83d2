"""`rollout.backend=http` against a real SGLang server: `HTTPEngines` drives SGLang 0.5.23 (installed for CPU in
.venv-sglang by scripts/setup_sglang.sh) serving a tiny random Qwen2, built here with transformers (K3 cannot
run there: fla's KDA kernels need CUDA), so what is checked is the wire protocol, against transformers (+ PEFT)
as the reference: log-probs and finish reasons of /generate, adapters loaded from a PEFT directory
(rollout.adapter_dir) and unloaded with their directories, an update aborting a request in flight by rid and
sending it again, memory release and resume, and a server that does not answer leaving the set. One server for
the module (it starts in about 20-95 s)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from miles_k3.data.sample import Sample
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.trainer.http_engines import HTTPEngines
from rollout.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(), reason=".venv-sglang is absent: run scripts/setup_sglang.sh"
)

TARGETS = ["o_proj", "gate_proj", "up_proj", "down_proj"]  # SGLang fuses Qwen2's q/k/v into qkv_proj
RANK, ALPHA = 4, 8.0
# SGLang's CPU path (scripts/setup_sglang.sh), its LoRA pool shaped for the adapters below
FLAGS = [
    "--skip-tokenizer-init",
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--dtype", "float32",
    "--skip-server-warmup",
    "--max-total-tokens", "8192",
    "--enable-lora",
    "--lora-backend", "torch_native",
    "--max-lora-rank", "8",
    "--max-loras-per-batch", "2",
    "--lora-target-modules", *TARGETS,
]  # fmt: skip
PROMPTS = ([5, 17, 33, 99, 200, 7], [250, 3, 64, 128])
LONG = 1000  # new tokens of the request an update aborts: several seconds on this CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.port = model, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> None:
        cmd = [str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(self.model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *FLAGS]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
        with open(self.log, "wb") as log:  # its own session: the scheduler and detokenizer are in its group
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"the SGLang server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail(f"the SGLang server did not answer /health in {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """Its process group (the scheduler and detokenizer too): SIGTERM, then SIGKILL to what is left."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, n: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def tiny_qwen2(path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("sglang")
    tiny_qwen2(tmp / "qwen2")
    srv = Server(tmp / "qwen2", tmp / "server.log")
    started = time.monotonic()
    failed = request.session.testsfailed
    srv.start()
    print(f"SGLang server up in {time.monotonic() - started:.1f} s", file=sys.stderr)
    yield srv
    srv.stop()
    if request.session.testsfailed > failed:  # the server's side of the failure, past the output capture
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\n--- SGLang server log ({srv.log}) ---\n{srv.tail()}", file=sys.stderr)


def base(server: Server):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32).eval()


def peft_model(server: Server, seed: int):
    """A LoRA of the Qwen2 with PEFT's random (non-zero) A and B on `TARGETS`."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(base(server), config).eval()


class Trainer:
    """The part of a trainer group `sync_adapter` reads: the adapter in engine naming (one part)."""

    def __init__(self, model):
        prefix = "base_model.model."
        self.tensors = {
            k[len(prefix) :].replace(".default.weight", ""): v.detach().clone()
            for k, v in model.state_dict().items()
            if ".lora_" in k
        }

    def adapter_parts(self):
        yield self.tensors


def engines(server: Server, tmp: Path, urls: list[str] | None = None, **kw) -> HTTPEngines:
    """SGLang loads adapters from a directory (rollout.adapter_dir) in its own naming (family "sglang")."""
    lora = LoraSpec(rank=RANK, alpha=ALPHA, targets=tuple(TARGETS))
    return HTTPEngines(urls or [server.url], lora, None, "sglang", adapter_dir=str(tmp / "adapters"), **kw)


def samples(groups: list[tuple[list[int], int]]) -> list[Sample]:
    """`n` samples of each (prompt, n), group by group."""
    return [
        Sample(prompt="", group_index=g, sample_index=i, prompt_ids=list(prompt))
        for g, (prompt, n) in enumerate(groups)
        for i in range(n)
    ]


def reference(model, sample: Sample) -> torch.Tensor:
    """The model's log-probs (temperature 1) of the sample's output tokens."""
    ids = torch.tensor([sample.prompt_ids + sample.output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(sample.prompt_ids)
    return logprobs[n - 1 : -1].gather(1, torch.tensor(sample.output_ids)[:, None])[:, 0]


def assert_logprobs_match(model, batch: list[Sample], atol: float = 1e-4) -> None:
    for s in batch:
        got = torch.tensor(s.logprobs)
        diff = (got - reference(model, s)).abs().max().item()
        assert diff < atol, f"sample {s.group_index}/{s.sample_index}: |SGLang - transformers| = {diff:.2e}"


def test_generate_fills_samples_with_transformers_logprobs_and_stop_tokens(server, tmp_path):
    http = engines(server, tmp_path)
    model = base(server)
    batch = samples([(PROMPTS[0], 2), (PROMPTS[1], 1)])
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i) for i in range(len(batch))]
    http.generate(batch, params)
    for s in batch:
        assert len(s.output_ids) == len(s.logprobs) == 12 and s.finish_reason == "length"
        assert s.loss_mask == [True] * 12 and s.policy_version == 0  # the base: no adapter synced yet
    assert_logprobs_match(model, batch)

    # greedy is reproducible (sampling_seed is accepted, but SGLang draws by it only with
    # --enable-deterministic-inference, which its torch_native attention does not support)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    first, again = samples([(PROMPTS[0], 1)]), samples([(PROMPTS[0], 1)])
    http.generate(first, [greedy])
    http.generate(again, [greedy])
    assert first[0].output_ids == again[0].output_ids and first[0].logprobs == again[0].logprobs
    assert_logprobs_match(model, first)  # greedy: log-probs at temperature 1

    # a stop token ends the output and is kept (no_stop_trim), finish_reason "stop"
    ids = first[0].output_ids
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    stopped = samples([(PROMPTS[0], 1)])
    http.generate(stopped, [SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(ids[at],))])
    assert stopped[0].output_ids == ids[: at + 1] and stopped[0].finish_reason == "stop"
    http.shutdown()


def test_adapters_load_from_a_directory_and_generate_as_peft(server, tmp_path):
    http = engines(server, tmp_path)
    first, second = peft_model(server, seed=1), peft_model(server, seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)

    stats = http.sync_adapter(Trainer(first))
    v1 = tmp_path / "adapters" / http.name(1)
    assert (v1 / "adapter_config.json").is_file() and stats["adapter_sync_sent_bytes_max"] > 0
    batch = samples([(PROMPTS[0], 2), (PROMPTS[1], 1)])
    http.generate(batch, [params] * 3)
    assert all(s.policy_version == 1 and s.token_fields["policy_version"] == [1] * 10 for s in batch)
    assert_logprobs_match(first, batch)
    with first.disable_adapter():  # the adapter changes them
        assert (torch.tensor(batch[0].logprobs) - reference(first, batch[0])).abs().max() > 1e-3

    http.sync_adapter(Trainer(second))  # keep_versions=1: version 1 is unloaded and its directory removed
    assert not v1.exists() and (tmp_path / "adapters" / http.name(2)).is_dir()
    assert http.alive == [server.url] and not http.failed
    old = httpx.post(
        f"{server.url}/generate",
        json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, "lora_path": http.name(1)},
        timeout=30,
    )
    # unloaded: SGLang would load it again from its path on a request naming it, and that is gone
    assert old.status_code == 400 and f"Failed to implicitly load LoRA adapter {http.name(1)}" in old.text
    batch = samples([(PROMPTS[1], 2)])
    http.generate(batch, [params] * 2)
    assert all(s.policy_version == 2 for s in batch)
    assert_logprobs_match(second, batch)

    http.shutdown()  # unloads version 2 and removes the run's directories
    assert list((tmp_path / "adapters").iterdir()) == []


def test_an_update_aborts_a_request_in_flight_and_sends_it_again(server, tmp_path):
    http = engines(server, tmp_path, keep_versions=2, partial="restart")
    update = Trainer(peft_model(server, seed=3))
    long = samples([(PROMPTS[0], 1)])
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            http.generate(long, [SamplingParams(temperature=1.0, max_new_tokens=LONG)])
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.inflight, "the request never went out"
    time.sleep(0.5)  # it reaches the server and decodes
    http.sync_adapter(update)  # aborts it by rid (/abort_request)
    thread.join(120)
    assert not thread.is_alive() and not errors, errors
    assert http.counters()["partial_resent"] >= 1
    s = long[0]  # sent again from scratch under version 1: complete, every token the new version's
    assert len(s.output_ids) == len(s.logprobs) == LONG and s.finish_reason == "length"
    assert s.policy_version == 1 and set(s.token_fields["policy_version"]) == {1}
    http.shutdown()


def test_release_and_resume_answer_and_generation_is_unchanged(server, tmp_path):
    http = engines(server, tmp_path)
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=16)]
    before, after = samples([(PROMPTS[1], 1)]), samples([(PROMPTS[1], 1)])
    http.generate(before, greedy)
    http.release()
    http.resume()
    assert http.alive == [server.url] and not http.failed
    http.generate(after, greedy)
    assert after[0].output_ids == before[0].output_ids
    # the release dropped the cached prefix: a full prefill now, whose float32 sums may differ in the last bits
    assert torch.allclose(torch.tensor(after[0].logprobs), torch.tensor(before[0].logprobs), rtol=0, atol=1e-5)
    http.shutdown()


def test_a_server_that_does_not_answer_leaves_the_set_and_the_samples_fill(server, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    http = engines(server, tmp_path, urls=[dead, server.url])
    batch = samples([(PROMPTS[0], 2), (PROMPTS[1], 1)])  # group 0 is dealt to the dead server first
    http.generate(batch, [SamplingParams(temperature=1.0, max_new_tokens=8)] * 3)
    assert all(len(s.output_ids) == 8 and s.finish_reason == "length" for s in batch)
    assert http.alive == [server.url] and list(http.failed) == [dead] and "Connect" in http.failed[dead]
    assert http.counters() == {"servers_lost": 1, "servers_restarted": 0, "partial_resent": 0}
    assert_logprobs_match(base(server), batch)
    http.shutdown()
