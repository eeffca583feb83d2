"""What a run records: metrics.jsonl (the source of truth), wandb (offline by default), a console progress bar.

metrics.jsonl holds one JSON object per line: a training row per step (`step`, `reward_mean`,
`train_rollout_logprob_abs_diff`, ...; with rollout.speculative also `spec_accept_len`,
`spec_draft_acceptance`, `spec_verify_tokens` and the engines' `rollout_spec_*` counts, and on a
distillation step `drafter_tv_before` / `drafter_tv_after`) and evaluation rows (`step`, `eval_accuracy`,
...). Each line is flushed when written. On resume from checkpoint step S, rows with step > S (written by the
interrupted run
after its last checkpoint) are moved to metrics.orphaned.jsonl; a run that starts from step 0 in a directory
that already holds rows (killed before its first checkpoint, or trainer.resume=never) moves them all. So
metrics.jsonl reads as one uninterrupted run, each step's rows once, and nothing is thrown away.

wandb: one run per run directory, its id kept in <run_dir>/wandb_id and resumed (`resume="allow"`) by
every restart, so a requeued job logs into the same run. A preemption stops right after a checkpoint, so
wandb never sees a step twice; after a hard kill (SIGKILL, a node lost) wandb already holds the rows past
the checkpoint and keeps its first copy (it ignores a step logged again; metrics.jsonl is the reference).
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
ORPHANED = "metrics.orphaned.jsonl"


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a missing value reads as null
    return v


def truncate_metrics(run_dir: str | Path, last_step: int) -> int:
    """Keep rows with step <= last_step in metrics.jsonl (atomically rewritten); move the rest to
    metrics.orphaned.jsonl. Returns how many rows moved. A torn last line (a kill mid-write) moves too."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            (keep if int(row["step"]) <= last_step else moved).append(line)
        except (ValueError, KeyError, TypeError):
            moved.append(line)
    if moved:
        with open(Path(run_dir) / ORPHANED, "a") as f:
            f.write("".join(m + "\n" for m in moved))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, path)
    return len(moved)


class RunLog:
    """Appends rows to metrics.jsonl and mirrors them to wandb. One per run, on the driver process.
    `resume_step`: the checkpoint step the run continues from; None: it starts at step 0."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb_mode: str,
        project: str,
        run_name: str | None,
        config: dict[str, Any],
        resume_step: int | None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # rows after the checkpoint resumed from (or any, starting over) were written by an interrupted run
        moved = truncate_metrics(self.run_dir, -1 if resume_step is None else resume_step)
        if moved:
            log.warning(
                "%s: moved %d metrics rows of the interrupted run to %s",
                "starting at step 0" if resume_step is None else f"resuming at step {resume_step}",
                moved,
                ORPHANED,
            )
        self._file = open(self.run_dir / METRICS, "a")
        self._wandb = None
        if wandb_mode != "disabled":
            self._wandb = self._init_wandb(wandb_mode, project, run_name, config)

    def _init_wandb(self, mode: str, project: str, run_name: str | None, config: dict[str, Any]):
        import wandb

        # One wandb run per run directory, resumed across restarts.
        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        tmp = id_file.with_suffix(".tmp")
        tmp.write_text(run_id)
        os.replace(tmp, id_file)  # a kill mid-write must not leave an empty id (a new wandb run next time)
        return wandb.init(
            mode=mode,
            project=project,
            name=run_name or self.run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, row: dict[str, Any]) -> None:
        row = {k: _jsonable(v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class Progress:
    """A rich progress bar with ETA and the latest reward / accuracy; a no-op when disabled."""

    def __init__(self, total: int, start: int, enabled: bool):
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, info: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
