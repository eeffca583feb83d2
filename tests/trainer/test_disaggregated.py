"""cluster.mode=disaggregated: `miles-train` starts its engine servers itself (`EngineFleet`), drives them by the
HTTP backend ahead of training, and restarts one killed mid-run: the run finishes with every step once, the
server back under the same address with the current adapter; its config rules fail by field."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from miles_k3.trainer.resolve import resolve
from tests.trainer.recipes import composed
from tests.trainer.test_cli_run import cli, rows

MODE = ["cluster.mode=disaggregated", "rollout.backend=http", "logging.wandb=disabled", "trainer.eval_before=false"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_engine_server_killed_mid_run_is_restarted_and_every_step_logged_once(tmp_path):
    run = tmp_path / "run"
    index = run / "engines.json"
    killed = {}

    def kill_after_step_one() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.is_file() and any('"step": 1' in x for x in metrics.read_text().splitlines()):
                (url, pid), *_ = json.loads(index.read_text()).items()
                os.kill(pid, signal.SIGKILL)
                killed.update(url=url, pid=pid)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_step_one, daemon=True)
    killer.start()
    out = cli(run, "trainer.max_steps=4", "cluster.engine_workers=1", *MODE)
    killer.join()
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in rows(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert sum(r["rollout_servers_lost"] for r in steps) == 1
    assert sum(r["rollout_servers_restarted"] for r in steps) == 1  # the only server: the step waited for it
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)  # it serves the current adapter
    now = json.loads(index.read_text())
    assert list(now) == [killed["url"]] and now[killed["url"]] != killed["pid"]  # the same address, a new process
    assert not any(alive(pid) for pid in now.values())  # the run stopped its servers


def test_two_engine_servers_run_ahead_of_training(tmp_path):
    run = tmp_path / "run"
    out = cli(run, "trainer.max_steps=3", "cluster.engine_workers=2", "rollout.max_staleness=1", *MODE)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in rows(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert max(r["policy_staleness_max"] for r in steps) == 1
    assert len(json.loads((run / "engines.json").read_text())) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.mode=disaggregated"], "cluster.mode=disaggregated drives its engine servers by SGLang's API"),
        (
            ["cluster.mode=disaggregated", "rollout.backend=http", "rollout.urls=[http://127.0.0.1:1]"],
            "rollout.urls: cluster.mode=disaggregated starts the engine servers itself",
        ),
        (["cluster.engine_workers=2"], "cluster.engine_workers only applies with cluster.mode=disaggregated"),
        (["cluster.mode=split"], "cluster.mode must be one of"),
        (
            ["cluster.mode=disaggregated", "rollout.backend=http", "rollout.page_size=32"],
            "rollout.page_size: the engine servers do not take it yet",
        ),
        (
            ["cluster.mode=disaggregated", "rollout.backend=http", "model.path=null", "model.preset=k3-tiny"],
            "model.path: the engine servers load the base from a checkpoint",
        ),
    ],
)
def test_bad_disaggregated_settings_fail_by_field(overrides, message):
    with pytest.raises(ValueError) as e:
        resolve(composed(*overrides))
    assert str(e.value).startswith(message), str(e.value)


def test_the_servers_take_the_runs_engine_layout():
    from miles_k3.trainer.engine_fleet import serve_flags

    rc = resolve(composed(*MODE, "rollout.tp=2", "rollout.ep=true", "rollout.max_staleness=2", "lora.rank=4"))
    flags = serve_flags(rc)
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["--tp"] == "2" and "--ep" in flags and pairs["--max-loras"] == "4" and pairs["--max-lora-rank"] == "4"
    assert Path(pairs["--model"]).is_dir() and pairs["--tokenizer"] == "arithmetic"


def test_a_stopped_fleet_starts_nothing_again(tmp_path):
    from miles_k3.trainer.engine_fleet import EngineFleet

    fleet = EngineFleet(resolve(composed(*MODE)), tmp_path)
    fleet.devices["http://127.0.0.1:1"] = None
    fleet.stop()
    with pytest.raises(ValueError, match="is not started again: the run is ending"):
        fleet.restart("http://127.0.0.1:1")
