"""Routing replay measured: the same GRPO run with the engine's routing recorded, once with the trainer's own
routers (`algo.routing_replay=off`) and once replaying the engine's experts (`rollout`), through the real
`miles-train`. Prints, per arm, the trainer/engine routing agreement (mean and worst layer), the train/rollout
|d logp| (mean and max) and k3 KL, the clip fraction, the last reward and the step time, averaged over the
steps (agreement and gaps also at the first step); writes the rows as JSON.

    python scripts/bench_routing.py --recipe k3_grpo --steps 5                        # CPU, the embedded K3
    python scripts/bench_routing.py --recipe k3_small_gpu --steps 50 --arms off,rollout \\
        --json routing.json rollout.quantize=experts                                  # bf16 trainer vs MXFP4 engine

Extra arguments are `miles-train` overrides for both arms. `--arms` picks which to run (a device call that
cannot hold both runs one arm per call; `--reuse` keeps an arm whose metrics.jsonl is complete).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

MEANS = (
    "routing_agreement",
    "routing_agreement_min_layer",
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_abs_diff_max",
    "train_rollout_kl",
    "pg_clipfrac",
    "step_s",
)


def run_arm(name: str, arm: list[str], args, work: Path) -> Path:
    """One `miles-train` run with the arm's own overrides `arm` (then `args.overrides`); its run directory
    (`work`/`name`)."""
    run_dir = work / name
    metrics = run_dir / "metrics.jsonl"
    if args.reuse and metrics.is_file() and any(r.get("step") == args.steps for r in _rows(metrics)):
        return run_dir
    cmd = [
        sys.executable,
        "-m",
        "miles_k3.cli.train",
        f"recipe={args.recipe}",
        *arm,
        f"trainer.max_steps={args.steps}",
        "trainer.save_every=0",
        "trainer.eval_every=0",
        "trainer.eval_before=false",
        "logging.progress=false",
        "logging.wandb=disabled",
        f"hydra.run.dir={run_dir}",
        *args.overrides,
    ]
    subprocess.run(cmd, check=True)
    return run_dir


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def summarize(label: dict, run_dir: Path, means: tuple[str, ...] = MEANS, skip_first: bool = False) -> dict:
    """The arm's row: its `label`, `means` averaged over its steps (`skip_first`: over those after the first,
    which pays the one-time set-up) and their first step's value, the last reward."""
    steps = [r for r in _rows(run_dir / "metrics.jsonl") if "reward_mean" in r]
    row = {**label, "steps": len(steps), "reward_last": steps[-1]["reward_mean"]}
    for name in means:
        values = [r[name] for r in steps if name in r and math.isfinite(r[name])]
        averaged = values[1:] if skip_first and len(values) > 1 else values
        row[name] = sum(averaged) / len(averaged) if averaged else float("nan")
        row[f"{name}_first"] = values[0] if values else float("nan")
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="k3_grpo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--arms", default="off,rollout", help="algo.routing_replay values, in order")
    parser.add_argument("--work-dir", default="outputs/bench_routing")
    parser.add_argument("--reuse", action="store_true", help="keep an arm whose run finished")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("overrides", nargs="*", help="miles-train overrides for both arms")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    rows = [
        summarize(
            {"replay": arm},
            run_arm(f"replay_{arm}", ["rollout.record_routing=true", f"algo.routing_replay={arm}"], args, work),
        )
        for arm in args.arms.split(",")
    ]
    print(
        f"{'replay':>8} {'agree':>7} {'worst':>7} {'|dlogp|':>9} {'max':>9} {'k3 KL':>9} {'clip':>6} "
        f"{'reward':>7} {'step s':>7}"
    )
    for r in rows:
        print(
            f"{r['replay']:>8} {r['routing_agreement']:7.4f} {r['routing_agreement_min_layer']:7.4f} "
            f"{r['train_rollout_logprob_abs_diff']:9.2e} {r['train_rollout_logprob_abs_diff_max']:9.2e} "
            f"{r['train_rollout_kl']:9.2e} {r['pg_clipfrac']:6.3f} {r['reward_last']:7.3f} {r['step_s']:7.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
