"""What the Slurm tests share: the shortened embedded run's overrides, and waiting on jobs."""

import json
import time
from pathlib import Path

# the embedded run, shortened: a few groups, no evaluation, one thread
SMALL = [
    "recipe=k3_grpo",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=4",
    "data.eval_path=null",
    "logging.progress=false",
    "cluster.threads_per_worker=1",
]


def job_field(slurm, job_id: str, name: str) -> str:
    text = slurm.run("scontrol", "show", "job", job_id).stdout
    return next(w.split("=", 1)[1] for w in text.split() if w.startswith(f"{name}="))


def wait_for(what, ready, timeout: float = 300, poll: float = 0.1):
    deadline = time.time() + timeout
    while not (got := ready()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)
    return got


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def finish(slurm, job_id: str, timeout: float = 600, hold: float = 3.0) -> str:
    """Wait until the job ends; its final state. A requeued job is made eligible `hold` seconds after it
    turns PENDING, not after Slurm's whole requeue delay: made eligible at once, its new run can reach a
    node before that node's slurmd has revoked the first run's credential, and is killed as "Job credential
    revoked" (FAILED; seen 2026-12-02, one run in three)."""
    pending: list[float] = []

    def ended():
        state = job_field(slurm, job_id, "JobState")
        if state != "PENDING":
            pending.clear()
        elif not pending:
            pending.append(time.time())
        elif time.time() - pending[0] >= hold:
            slurm.run("scontrol", "update", f"jobid={job_id}", "StartTime=now", check=False)
        return state if state in ENDED else None

    return wait_for(f"job {job_id} to end", ended, timeout, poll=0.5)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
