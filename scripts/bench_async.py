"""Asynchronous RL measured: the same GRPO run colocated and synchronous, then with engines of its own
(`cluster.mode=disaggregated`: `--servers` engine servers the run starts, on GPUs after the trainer's on a
multi-GPU machine) at rollout.max_staleness 0, 1, 2, ...: samples per second over the run's steps, the trainer's
wait for rollouts, the staleness trained on, and the reward curve.

    python scripts/bench_async.py --recipe k3_grpo_steps --steps 20 --staleness 0,1,2 --json async.json
    python scripts/bench_async.py --steps 3 --staleness 0,1 rollout.prompts_per_step=4      # a quick check

Every arm is one `miles-train` run of `--steps` steps with the same overrides (so the same prompts, seeds and
total samples); the disaggregated arms' servers are the recipe's engine (`engine_fleet.serve_flags`).
samples/s is the run's samples over the sum of its step times; the speedup is against the colocated arm.
Extra arguments are `miles-train` overrides for every arm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = ["trainer.eval_before=false", "trainer.eval_every=0", "trainer.save_every=0", "logging.wandb=disabled"]
RUN += ["logging.progress=false", "cluster.threads_per_worker=1"]


def resolved(recipe: str, overrides: list[str]):
    from miles_k3.trainer.config import compose_recipe
    from miles_k3.trainer.resolve import resolve

    return resolve(compose_recipe(f"recipe={recipe}", *overrides))


def train(args, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "miles_k3.cli.train", f"recipe={args.recipe}", f"trainer.max_steps={args.steps}"]
    cmd += [*RUN, *args.overrides, *extra, f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(extra) or 'colocated'}: miles-train failed: {out.stderr[-2000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r or "samples_per_s" in r]


def summarize(arm: str, steps: list[dict], per_step: int) -> dict:
    wall = sum(r["step_s"] for r in steps)
    rewards = [r["reward_mean"] for r in steps]
    return {
        "arm": arm,
        "steps": len(steps),
        "samples_per_s": len(steps) * per_step / wall,
        "step_s_mean": wall / len(steps),
        "rollout_wait_s_mean": sum(r["rollout_s"] for r in steps) / len(steps),
        "train_s_mean": sum(r["train_s"] for r in steps) / len(steps),
        "staleness_mean": sum(r.get("policy_staleness_mean", 0.0) for r in steps) / len(steps),
        "reward_first_half": sum(rewards[: len(rewards) // 2]) / max(1, len(rewards) // 2),
        "reward_second_half": sum(rewards[len(rewards) // 2 :]) / max(1, len(rewards) - len(rewards) // 2),
        "rewards": rewards,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="k3_grpo_steps")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--staleness", default="0,1,2", help="rollout.max_staleness of the HTTP arms")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--work-dir", type=Path, default=Path("outputs/bench_async"))
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    rc = resolved(args.recipe, args.overrides)
    per_step = rc.rollout.prompts_per_step * rc.rollout.samples_per_prompt
    rows = [summarize("colocated", train(args, args.work_dir / "colocated", []), per_step)]
    own = ["cluster.mode=disaggregated", f"cluster.engine_workers={args.servers}", "rollout.backend=http"]
    for k in (int(x) for x in args.staleness.split(",")):
        extra = [*own, f"rollout.max_staleness={k}"]
        rows.append(summarize(f"http k={k}", train(args, args.work_dir / f"http_k{k}", extra), per_step))
    base = rows[0]["samples_per_s"]
    print(
        f"{'arm':12} {'steps':>5} {'samples/s':>9} {'x':>5} {'step s':>7} {'wait s':>7} {'train s':>7} "
        f"{'stale':>5} {'reward 1st/2nd half':>20}"
    )
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base
        print(
            f"{r['arm']:12} {r['steps']:5d} {r['samples_per_s']:9.1f} {r['speedup']:5.2f} {r['step_s_mean']:7.2f} "
            f"{r['rollout_wait_s_mean']:7.2f} {r['train_s_mean']:7.2f} {r['staleness_mean']:5.2f} "
            f"{r['reward_first_half']:9.3f} / {r['reward_second_half']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
