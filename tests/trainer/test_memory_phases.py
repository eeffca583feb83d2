"""Memory phases of the colocated loop: what is idle in a phase waits on the host (`miles_k3.offload.Parked`):
the engine's weights while the trainer trains (rollout.offload_weights), the trainer's frozen base and
optimizer state while the engines roll out (parallel.offload_base / offload_optimizer). Parking frees the
device storages, restoring brings back the same bytes into the same storages, and a run with every offload on
is the run without, number for number, with less memory in each phase."""

import json
from pathlib import Path

import pytest
import torch

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.offload import Parked, resident_bytes
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import SamplingParams


def test_parking_frees_each_storage_once_and_restores_it_bit_for_bit():
    w = torch.randn(4, 6)
    top, bottom = w[:2], w[2:]  # two views of one storage: parked once
    p = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    before = w.clone(), p.detach().clone()
    assert resident_bytes([top, bottom, p]) == (24 + 3) * 4
    parked = Parked([top, bottom, p, w])
    assert parked.nbytes == (24 + 3) * 4 and resident_bytes([w, p]) == 0
    parked.restore()
    assert torch.equal(w, before[0]) and torch.equal(p, before[1])
    assert top.data_ptr() == w.data_ptr() and torch.equal(bottom, before[0][2:])  # still views of w
    with pytest.raises(RuntimeError, match="already restored"):
        parked.restore()


def test_an_engine_released_with_its_weights_generates_the_same_tokens_after_resume():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
    eng = Engine(model, EngineConfig(memory_bytes=4 << 20, page_size=4, chunk_size=8, max_seq_len=128))
    params = SamplingParams(temperature=0, max_new_tokens=8)
    prompts = [[1, 5, 9, 13, 2], [1, 7, 7]]
    first = [c.output_ids for c in eng.generate(prompts, params)]
    weights = resident_bytes([*model.parameters(), *model.buffers()])
    eng.release_memory(weights=True)
    assert resident_bytes([*model.parameters(), *model.buffers()]) == 0 and eng.memory.resident_bytes() == 0
    eng.resume_memory()
    assert resident_bytes([*model.parameters(), *model.buffers()]) == weights
    again = eng.generate(prompts, params)
    assert [c.output_ids for c in again] == first
    eng.release_memory()  # without weights: the pools alone
    assert resident_bytes([*model.parameters(), *model.buffers()]) == weights
    eng.resume_memory()


def test_every_offload_on_trains_the_same_numbers_with_less_memory_in_each_phase(tmp_path):
    from tests.trainer.test_cli_run import cli

    flags = ["trainer.max_steps=2", "logging.wandb=disabled", "trainer.eval_before=false", "trainer.deterministic=true"]
    offload = ["parallel.offload_optimizer=true", "parallel.offload_base=true", "rollout.offload_weights=true"]
    runs = {}
    for name, extra in (("kept", []), ("parked", offload)):
        out = cli(tmp_path / name, *flags, *extra)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = (Path(tmp_path / name) / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(x) for x in lines if "loss" in json.loads(x)]
    for kept, parked in zip(runs["kept"], runs["parked"]):
        for key in ("reward_mean", "loss", "grad_norm", "train_rollout_logprob_abs_diff"):
            assert parked[key] == kept[key], key
        # training: the engine's weights are on the host; rolling out: the trainer's base and optimizer state
        assert parked["memory_train_bytes_max"] < kept["memory_train_bytes_max"]
        assert parked["memory_rollout_bytes_max"] < kept["memory_rollout_bytes_max"]


def test_offloading_the_engine_weights_needs_the_pools_released():
    from miles_k3.trainer.resolve import resolve
    from tests.trainer.recipes import composed

    with pytest.raises(ValueError, match=r"^rollout\.offload_weights needs rollout\.release_memory=true"):
        resolve(composed("rollout.offload_weights=true", "rollout.release_memory=false"))


def test_a_checkpoint_written_with_the_optimizer_parked_resumes(tmp_path):
    """The optimizer's state goes to the checkpoint as host copies: parking it right after (the rollout phase
    begins) leaves the file whole, and a resumed run continues from it."""
    from tests.trainer.test_cli_run import cli, rows

    flags = ["logging.wandb=disabled", "trainer.eval_before=false", "parallel.offload_optimizer=true"]
    first = cli(tmp_path / "run", "trainer.max_steps=2", "trainer.save_every=1", *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    moments = [v for s in state["workers"][0]["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert moments and all(v.untyped_storage().nbytes() > 0 for v in moments)
    more = cli(tmp_path / "run", "trainer.max_steps=3", *flags)
    assert more.returncode == 0, more.stderr[-3000:]
    assert [r["step"] for r in rows(tmp_path / "run") if "loss" in r] == [1, 2, 3]
