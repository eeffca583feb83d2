"""The colocated loop's device memory per phase, with and without offloading the idle side: each arm one
`miles-train` run; the figures are its steps' `memory_rollout_bytes_max` / `memory_train_bytes_max` (on a GPU
the allocator's peak in each phase on the fullest rank, on CPU what the trainer's and engine's tensors hold).

    python scripts/bench_memory_phases.py --recipe k3_small_gpu --steps 3 --json phases.json      # one GPU
    python scripts/bench_memory_phases.py --steps 2 rollout.prompts_per_step=4                    # CPU check

Arms: `kept` (pools released during training, nothing offloaded) and `offloaded` (parallel.offload_optimizer,
parallel.offload_base and rollout.offload_weights on). The last step's figures are reported (the first
compiles and captures); the run's losses must agree between the arms (printed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "kept": ["rollout.release_memory=true"],
    "offloaded": [
        "rollout.release_memory=true",
        "parallel.offload_optimizer=true",
        "parallel.offload_base=true",
        "rollout.offload_weights=true",
    ],
}
RUN = ["trainer.eval_before=false", "trainer.eval_every=0", "trainer.save_every=0", "logging.wandb=disabled"]
RUN += ["logging.progress=false", "trainer.deterministic=true"]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="k3_grpo")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=Path("outputs/bench_memory_phases"))
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    rows = []
    for arm, extra in ARMS.items():
        run = args.work_dir / arm
        cmd = [sys.executable, "-m", "miles_k3.cli.train", f"recipe={args.recipe}", f"trainer.max_steps={args.steps}"]
        out = subprocess.run([*cmd, *RUN, *extra, *args.overrides, f"hydra.run.dir={run}"], cwd=REPO)
        if out.returncode != 0:
            raise SystemExit(f"{arm}: miles-train exited {out.returncode}")
        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if "loss" in r]
        last = steps[-1]
        rows.append(
            {
                "arm": arm,
                "rollout_gib": last["memory_rollout_bytes_max"] / 2**30,
                "train_gib": last["memory_train_bytes_max"] / 2**30,
                "step_s": last["step_s"],
                "losses": [r["loss"] for r in steps],
            }
        )
    print(f"{'arm':10} {'rollout GiB':>11} {'train GiB':>10} {'step s':>7}  losses")
    for r in rows:
        losses = " ".join(f"{x:.6g}" for x in r["losses"])
        print(f"{r['arm']:10} {r['rollout_gib']:11.3f} {r['train_gib']:10.3f} {r['step_s']:7.2f}  {losses}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
