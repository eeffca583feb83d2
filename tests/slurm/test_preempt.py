"""Preemption without a cluster (what Slurm does to a job, done by hand): the signal watcher's contract,
`miles-train` stopping on SIGTERM after a checkpoint of the step in flight with status 75 and resuming into
the uninterrupted run's metrics, every rank of a local two-rank world surviving the signal, and RunLog never
repeating a step's row on a restart."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from miles_k3.trainer import checkpoint as ckpt
from miles_k3.trainer import preempt
from miles_k3.trainer.run_log import METRICS, ORPHANED, RunLog
from tests.slurm.jobs import SMALL, rows, wait_for

TIMING = {"rollout_s", "train_s", "step_s", "samples_per_s", "adapter_sync_ms"}


def test_watch_records_the_first_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with preempt.watch():
        assert preempt.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
        assert preempt.requested() == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) is before
    with preempt.watch():  # each watch starts clean
        assert preempt.requested() is None


def test_preempted_exits_with_the_requeue_status_and_no_traceback():
    code = "from miles_k3.trainer.preempt import Preempted; raise Preempted('SIGTERM', 3)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == preempt.PREEMPTED_EXIT == 75
    assert "Traceback" not in out.stderr


def test_a_fresh_start_moves_an_interrupted_runs_rows_aside(tmp_path):
    # killed before its first checkpoint: the restart begins at step 0 again and must not repeat its rows
    (tmp_path / METRICS).write_text('{"step": 0, "eval_accuracy": 0.5}\n{"step": 1, "loss": 0.1}\n')
    log = RunLog(tmp_path, wandb_mode="disabled", project="p", run_name=None, config={}, resume_step=None)
    log.log({"step": 0, "eval_accuracy": 0.5})
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / METRICS).read_text().splitlines()] == [0]
    assert len((tmp_path / ORPHANED).read_text().splitlines()) == 2


def cli(run_dir: Path, *overrides: str, wait: bool = True):
    cmd = [sys.executable, "-m", "miles_k3.cli.train", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_SILENT": "true"}
    if not wait:  # its own process group: a signal to the group reaches every rank, as Slurm's does
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def stable(rs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]


def test_sigterm_stops_after_a_checkpoint_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    flags = ["trainer.max_steps=4", "trainer.save_every=0", "trainer.deterministic=true", "logging.wandb=disabled"]
    ref = cli(tmp_path / "ref", *flags)
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = tmp_path / "run"
    proc = cli(run, *flags, wait=False)
    wait_for("step 1's row", lambda: proc.poll() is None and (run / METRICS).exists() and rows(run))
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=300) == preempt.PREEMPTED_EXIT, proc.stderr.read().decode()[-3000:]
    ((step, path),) = ckpt.list_checkpoints(run / "checkpoints")  # save_every=0: the preemption's own
    assert ckpt.verify_checkpoint(path) is None and step < 4
    assert [r["step"] for r in rows(run)] == list(range(1, step + 1))

    resumed = cli(run, *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {step})" in resumed.stdout + resumed.stderr
    assert stable(rows(run)) == stable(rows(tmp_path / "ref"))


def test_every_rank_of_a_local_world_outlives_the_signal_until_the_checkpoint(tmp_path):
    run = tmp_path / "tp2"
    proc = cli(
        run,
        "parallel=tp2",
        "cluster.num_workers=2",
        "trainer.max_steps=5",
        "trainer.save_every=0",
        "logging.wandb=disabled",
        wait=False,
    )
    wait_for("step 1's row", lambda: proc.poll() is None and (run / METRICS).exists() and rows(run), timeout=600)
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher and both ranks, as Slurm signals a job
    assert proc.wait(timeout=300) == preempt.PREEMPTED_EXIT, proc.stderr.read().decode()[-3000:]
    ((step, path),) = ckpt.list_checkpoints(run / "checkpoints")
    assert ckpt.verify_checkpoint(path) is None
    assert len(torch.load(path / ckpt.STATE_FILE, weights_only=False)["workers"]) == 2  # both ranks' states
    assert [r["step"] for r in rows(run)] == list(range(1, step + 1))
