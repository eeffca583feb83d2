"""scripts/slurm/train.sbatch against the real test Slurm cluster (conftest.py): a shortened embedded run
through `sbatch --wait`; a job requeued mid-run finishing with every step's row once, resumed from its
checkpoint into the same wandb run; SIGTERM mid-step leaving a valid checkpoint of the step in flight and no
partial files; the time-limit warning (USR1) requeueing the job from the batch file itself."""

import subprocess
import sys
from pathlib import Path

import pytest

from miles_k3.trainer import checkpoint as ckpt
from miles_k3.trainer.preempt import PREEMPTED_EXIT
from tests.slurm.jobs import SMALL, finish, job_field, rows, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "scripts" / "slurm" / "train.sbatch"


def submit(slurm, run_dir: Path, *overrides: str, wait: bool = False, name: str = "mk3", bare: bool = False):
    """sbatch train.sbatch; the job id, or with `wait` the finished sbatch (its return code is the job's exit
    code). The test's python is named by MILES_K3_PYTHON; `bare`: no environment at all (--export=NONE), the
    file finds the python itself."""
    env = {**slurm.env(), "MILES_K3_PYTHON": sys.executable, "WANDB_SILENT": "true"}
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name={name}",
        "--cpus-per-task=1",
        *(["--export=NONE"] if bare else []),
        f"--output={run_dir.parent}/{run_dir.name}.slurm-%j.out",
        *(["--wait"] if wait else []),
        str(TRAIN),
        *SMALL,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=900)
    if wait:
        return out
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def log_of(run_dir: Path, job_id: str) -> str:
    return (run_dir / f"slurm-{job_id}.out").read_text()


def test_sbatch_wait_runs_a_short_embedded_run_and_writes_its_metrics(slurm, tmp_path):
    run = tmp_path / "run"
    # with the checkout's .venv (as README sets up), from an empty environment: the file finds it unedited
    venv = (REPO / ".venv" / "bin" / "python").exists()
    out = submit(slurm, run, "trainer.max_steps=2", "logging.wandb=disabled", wait=True, bare=venv)
    assert out.returncode == 0, (out.stderr, *(p.read_text()[-3000:] for p in run.glob("slurm-*.out")))
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows(run))
    job_id = out.stdout.strip().split(";")[0]
    # the trainer's output is in the run directory; Slurm's own file says where
    assert "step 2/2" in log_of(run, job_id)
    assert f"run directory {run}" in (tmp_path / f"run.slurm-{job_id}.out").read_text()
    if venv:
        assert f": {REPO}/scripts/slurm/../../.venv/bin/python" in log_of(run, job_id)  # the file's own checkout
    assert ckpt.verify_checkpoint(run / "checkpoints" / "step_00000002") is None


def test_requeued_mid_run_resumes_from_its_checkpoint_with_every_row_once(slurm, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm, run, "trainer.max_steps=4", "trainer.save_every=1", "logging.wandb=offline")
    wait_for("the step-2 checkpoint", lambda: (run / "checkpoints" / "step_00000002").exists())
    slurm.run("scontrol", "requeue", job)
    assert finish(slurm, job) == "COMPLETED", log_of(run, job)[-3000:]
    assert job_field(slurm, job, "Restarts") == "1"
    log = log_of(run, job)
    assert log.count(" start ") == 2 and "resumed from" in log
    steps = [r["step"] for r in rows(run)]
    assert steps == [1, 2, 3, 4], steps
    # the restart logged into the same wandb run (offline: one directory per start, one run id)
    ids = {p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")}
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2 and ids == {(run / "wandb_id").read_text()}


def test_sigterm_mid_step_leaves_a_valid_checkpoint_and_no_partial_files(slurm, tmp_path):
    run = tmp_path / "run"
    # checkpoints only at the end: the one the signal leaves is the preemption's own
    job = submit(slurm, run, "trainer.max_steps=6", "trainer.save_every=0", "logging.wandb=disabled")
    wait_for("step 1's row", lambda: (run / "metrics.jsonl").exists() and rows(run))
    # SIGTERM to the batch shell and the trainer, as at a preemption, without cancelling the job
    slurm.run("scancel", "--full", "--signal=TERM", job)
    assert finish(slurm, job) == "FAILED"
    assert job_field(slurm, job, "ExitCode") == f"{PREEMPTED_EXIT}:0"
    assert job_field(slurm, job, "Restarts") == "0"  # a SIGTERM is Slurm's to requeue, not the batch file's
    published = ckpt.list_checkpoints(run / "checkpoints")
    assert len(published) == 1, published
    step, path = published[0]
    assert ckpt.verify_checkpoint(path) is None and 2 <= step < 6
    assert [r["step"] for r in rows(run)] == list(range(1, step + 1))
    assert not list((run / "checkpoints").glob(".*")) and not list(run.glob("*.tmp"))
    assert f"SIGTERM: stopping after step {step}/6" in log_of(run, job)


def test_time_limit_warning_requeues_the_job_from_the_batch_file(slurm, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm, run, "trainer.max_steps=3", "trainer.save_every=0", "logging.wandb=disabled")
    wait_for("step 1's row", lambda: (run / "metrics.jsonl").exists() and rows(run))
    # what --signal=B:USR1@N sends ahead of the time limit: the batch shell only
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    assert finish(slurm, job) == "COMPLETED", log_of(run, job)[-3000:]
    assert job_field(slurm, job, "Restarts") == "1"
    log = log_of(run, job)
    assert "SIGUSR1: stopping after step" in log and "time limit near: requeueing" in log
    assert [r["step"] for r in rows(run)] == [1, 2, 3]


def test_no_python_that_imports_miles_k3_is_one_clear_line(slurm, tmp_path):
    # a copy of the file away from any checkout, no virtualenv, a PATH whose python3 lacks the package
    copy = tmp_path / "train.sbatch"
    copy.write_text(TRAIN.read_text())
    env = {**slurm.env(), "MILES_K3_PYTHON": "/nonexistent/python", "PATH": "/usr/bin:/bin"}
    env.pop("VIRTUAL_ENV", None)
    out_file = tmp_path / "out"
    done = subprocess.run(
        ["sbatch", "--wait", "--cpus-per-task=1", f"--output={out_file}", str(copy), "trainer.max_steps=1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no python that imports miles_k3; set MILES_K3_PYTHON" in out_file.read_text()
