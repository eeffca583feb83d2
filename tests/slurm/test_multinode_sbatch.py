"""scripts/slurm/train_multinode.sbatch on the test cluster's two emulated nodes (two slurmd on this host):
the srun launcher runs a real two-rank run with one rank on each node, stopped by the time-limit warning,
requeued and resumed; the Ray launcher runs the loop on a
real one-node Ray cluster, and places its head and worker steps on both nodes, runs the driver with the
cluster's address and stops only its own Ray processes (placeholder `ray` and python: two-node Ray cannot
run on one host, it rebinds to the external address)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.jobs import SMALL, finish, job_field, rows, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
MULTI = REPO / "scripts" / "slurm" / "train_multinode.sbatch"


def submit(
    slurm,
    tmp_path: Path,
    run_dir: Path,
    launcher: str,
    *overrides: str,
    env: dict | None = None,
    nodes: int = 2,
    cpus: int = 1,
) -> str:
    env = {
        **slurm.env(),
        "MILES_K3_PYTHON": sys.executable,
        "MILES_K3_LAUNCHER": launcher,
        "WANDB_SILENT": "true",
        **(env or {}),
    }
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={cpus}",
            f"--output={tmp_path}/slurm-%j.out",
            str(MULTI),
            *overrides,
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def nodes_that_ran(slurm, job: str) -> set[str]:
    """The nodes whose slurmd launched a task of one of `job`'s steps (their logs)."""
    return {
        n
        for n in ("n1", "n2")
        if re.search(rf"launch task StepId={job}\.\d+", (slurm.root / f"slurmd-{n}.log").read_text())
    }


def test_srun_launcher_trains_with_one_rank_on_each_node_and_resumes_after_the_time_limit_warning(slurm, tmp_path):
    run = tmp_path / "run"
    job = submit(
        slurm,
        tmp_path,
        run,
        "srun",
        *SMALL,
        "parallel=tp2",
        "trainer.max_steps=3",
        "trainer.save_every=0",
        "logging.wandb=disabled",
    )
    log = lambda: (run / f"slurm-{job}.out").read_text()  # noqa: E731
    wait_for("step 1's row", lambda: (run / "metrics.jsonl").exists() and rows(run), timeout=400)
    # the warning reaches the batch shell, which passes it to srun, which passes it to both ranks: rank 0
    # checkpoints, the job exits 75 (rank 1 is left to exit, not killed) and requeues itself
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    assert finish(slurm, job) == "COMPLETED", log()[-4000:]
    assert job_field(slurm, job, "Restarts") == "1"
    assert "trainer exited 75" in log() and "resumed from" in log()
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert nodes_that_ran(slurm, job) == {"n1", "n2"}
    # srun's labels: rank 0 (the driver's step lines) and rank 1 both wrote to the job's log
    assert re.search(r"^0: .*step 3/3", log(), re.M) and re.search(r"^1: ", log(), re.M)
    assert job_field(slurm, job, "NumNodes") == "2"


def test_ray_launcher_runs_the_loop_on_a_real_single_node_ray_cluster(slurm, tmp_path):
    # one node: the file's real `ray start --head`, the node wait, the driver with cluster.ray_address and
    # the teardown (this Ray build needs RAY_AUTH_MODE=disabled for a cluster started by `ray start`)
    run = tmp_path / "run"
    job = submit(
        slurm,
        tmp_path,
        run,
        "ray",
        *SMALL,
        "cluster=ray_cpu",
        "trainer.max_steps=2",
        "logging.wandb=disabled",
        nodes=1,
        cpus=2,
        env={"RAY_AUTH_MODE": "disabled"},
    )
    log = lambda: (run / f"slurm-{job}.out").read_text()  # noqa: E731
    assert finish(slurm, job) == "COMPLETED", log()[-4000:]
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert "ray cluster: 1 nodes up" in log() and "stopping this job's Ray processes" in log()
    assert rows(run)[0]["train_rollout_logprob_abs_diff"] < 1e-4


FAKE_RAY = """#!/usr/bin/env bash
# stands in for `ray start`: records where it ran and with what, blocks like --block until stopped
echo "$SLURMD_NODENAME ray $*" >> "$FAKE_LOG"
trap 'echo "$SLURMD_NODENAME ray stopped" >> "$FAKE_LOG"; exit 0' TERM
while :; do sleep 0.2; done
"""
FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for the venv's python: records the driver and the node waits; a wait for N nodes returns once N
# placeholder Ray processes have started, as the real one returns once N nodes joined
[ "$1" = -c ] && exit 0
echo "$SLURMD_NODENAME python $*" >> "$FAKE_LOG"
if [ "$3" = wait ]; then
    until [ "$(grep -c ' ray start' "$FAKE_LOG")" -ge "$5" ]; do sleep 0.1; done
fi
"""


def test_ray_launcher_places_head_and_worker_on_both_nodes_and_stops_only_them(slurm, tmp_path):
    fake_log = tmp_path / "calls"
    for name, text in (("ray", FAKE_RAY), ("python", FAKE_PYTHON)):
        (tmp_path / name).write_text(text)
        os.chmod(tmp_path / name, 0o755)
    run = tmp_path / "run"
    job = submit(
        slurm,
        tmp_path,
        run,
        "ray",
        "recipe=k3_grpo",
        "cluster.num_workers=2",
        env={
            "MILES_K3_PYTHON": str(tmp_path / "python"),
            "MILES_K3_RAY": str(tmp_path / "ray"),
            "FAKE_LOG": str(fake_log),
        },
    )
    assert finish(slurm, job) == "COMPLETED", (run / f"slurm-{job}.out").read_text()
    calls = fake_log.read_text().splitlines()
    port = 20000 + int(job) % 20000
    head = [c for c in calls if " ray start --head" in c]
    worker = [c for c in calls if " ray start --address" in c]
    assert len(head) == 1 and head[0].startswith("n1 ") and f"--port={port}" in head[0]
    assert len(worker) == 1 and worker[0].startswith("n2 ") and f"--address=127.0.0.1:{port}" in worker[0]
    assert "--block" in head[0] and "--block" in worker[0]
    # the driver waited for one node, then both, then ran on the first node with the cluster's address
    driver = [c for c in calls if "miles_k3.cli.train" in c]
    waits = [c for c in calls if "miles_k3.trainer.ray_launch wait" in c]
    assert [w.split()[-2] for w in waits] == ["1", "2"]
    assert len(driver) == 1 and driver[0].startswith("n1 ")
    for arg in (
        "recipe=k3_grpo",
        "cluster.num_workers=2",
        "cluster.launcher=ray",
        f"cluster.ray_address=127.0.0.1:{port}",
        f"hydra.run.dir={run}",
    ):
        assert arg in driver[0].split(), arg
    assert calls.index(waits[-1]) < calls.index(driver[0])
    # teardown: both of this job's Ray processes stopped (they were the job's own srun steps)
    assert sorted(c for c in calls if c.endswith("ray stopped")) == ["n1 ray stopped", "n2 ray stopped"]
    assert nodes_that_ran(slurm, job) == {"n1", "n2"}


def test_launcher_keys_are_the_files_own(slurm, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm, tmp_path, run, "ray", "cluster.launcher=local")
    assert finish(slurm, job) == "FAILED"
    assert job_field(slurm, job, "ExitCode") == "2:0"
    assert "cluster.launcher is set by this file" in (tmp_path / f"slurm-{job}.out").read_text()
