"""Speculation over a GRPO run: draft acceptance per step with the drafter kept in step with the policy
(online distillation) and without.

    python scripts/bench_spec_rl.py                                   # CPU, the embedded base
    python scripts/bench_spec_rl.py --steps 20 --distill-every 2 --json runs/bench_spec_rl.json

Two `miles-train` runs, same recipe, seed and settings, speculation on in both
(rollout.speculative.drafter): "frozen" keeps the drafter as loaded; "distilled" distils it every
`--distill-every` steps on that step's own rollouts against the policy with its new adapter
(rollout.speculative.distill_every), in place in the engine. Per step, from each run's metrics.jsonl:
mean accepted length (tokens a row advances per verify step), draft acceptance (kept / verified drafts),
verify tokens, the reward, and for the distilled run the drafter's total variation to the policy on
held-out rollouts of the step, before and after its distillation.

The recipe defaults to k3_grpo_steps (the worked-solution base, long predictable outputs) when
`miles_k3/assets/k3-tiny-steps` and its recipe are installed, else k3_grpo on k3-tiny-arith. The drafter
defaults to the base's shipped `drafter/`, else one trained here by scripts/train_drafter.py on that base
(`--drafter-steps`, small: a weak drafter leaves room for the online distillation to show; kept in --out
for the next invocation). A table on stdout, everything in `--json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "miles_k3" / "assets"
# recipe -> (its base's asset folder, the longest response it samples: train_drafter.py --max-new-tokens)
BASES = {"k3_grpo_steps": (ASSETS / "k3-tiny-steps", 48), "k3_grpo": (ASSETS / "k3-tiny-arith", 6)}
RUNS = ("frozen", "distilled")
PER_STEP = ("spec_accept_len", "spec_draft_acceptance", "spec_verify_tokens", "reward_mean", "rollout_s")


def default_recipe() -> str:
    """The worked-solution recipe when its base and recipe file are installed, else the arithmetic one."""
    steps = BASES["k3_grpo_steps"][0]
    if (steps / "config.json").is_file() and (ROOT / "recipes" / "recipe" / "k3_grpo_steps.yaml").is_file():
        return "k3_grpo_steps"
    return "k3_grpo"


def shipped_drafter(recipe: str) -> Path | None:
    base = BASES.get(recipe, (None,))[0]
    return base / "drafter" if base is not None and (base / "drafter" / "config.json").is_file() else None


def parse_args(argv=None) -> argparse.Namespace:
    recipe = default_recipe()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=recipe, help=f"the miles-train recipe (default here: {recipe})")
    ap.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="DSpark drafter directory; default: the recipe base's shipped one, else trained into --out",
    )
    ap.add_argument("--drafter-steps", type=int, default=150, help="train_drafter.py --steps, when it trains one")
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--samples-per-prompt", type=int, default=4)
    ap.add_argument("--distill-every", type=int, default=1, help="distilled run: steps between distillations")
    ap.add_argument(
        "--distill-steps",
        type=int,
        default=None,
        help="optimizer steps per distillation (default: rollout.speculative.distill_steps')",
    )
    ap.add_argument("--gamma", type=int, default=None, help="drafts per block (default: rollout.speculative.gamma's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_spec_rl", help="run directories")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("overrides", nargs="*", help="further miles-train overrides, applied to both runs")
    return ap.parse_args(argv)


def train_drafter(args) -> Path:
    """A drafter for the recipe's base from scripts/train_drafter.py (kept across invocations of this script)."""
    if args.recipe not in BASES:
        raise SystemExit(f"--recipe {args.recipe}: pass --drafter (a drafter is trained here for {sorted(BASES)})")
    base, max_new = BASES[args.recipe]
    out = args.out / f"drafter-{base.name}"
    if not (out / "model.safetensors").is_file():
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "train_drafter.py"),
            "--target",
            str(base),
            "--max-new-tokens",
            str(max_new),
            "--out",
            str(out),
            "--steps",
            str(args.drafter_steps),
            "--train-prompts",
            "400",
            "--heldout-prompts",
            "64",
            "--threads",
            str(args.threads),
        ]
        print("training a drafter:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def run(args, name: str, drafter: Path) -> list[dict]:
    """One miles-train run; its training rows (one per step) from metrics.jsonl."""
    run_dir = args.out / name
    spec = [f"rollout.speculative.drafter={drafter}"]
    if args.gamma is not None:
        spec.append(f"rollout.speculative.gamma={args.gamma}")
    if name == "distilled":
        spec.append(f"rollout.speculative.distill_every={args.distill_every}")
        if args.distill_steps is not None:
            spec.append(f"rollout.speculative.distill_steps={args.distill_steps}")
    cmd = [
        sys.executable,
        "-m",
        "miles_k3.cli.train",
        f"recipe={args.recipe}",
        f"trainer.max_steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts_per_step}",
        f"rollout.samples_per_prompt={args.samples_per_prompt}",
        f"trainer.seed={args.seed}",
        "trainer.save_every=0",
        "trainer.eval_before=false",
        "trainer.eval_every=0",
        "data.eval_max_prompts=1",
        "trainer.resume=never",
        "logging.wandb=disabled",
        "logging.progress=false",
        f"cluster.threads_per_worker={args.threads}",
        *spec,
        *args.overrides,
        f"hydra.run.dir={run_dir}",
    ]
    print(f"{name}: miles-train {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_SILENT": "true"})
    if out.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return [r for r in rows if "reward_mean" in r]


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    drafter = args.drafter or shipped_drafter(args.recipe) or train_drafter(args)
    runs = {name: run(args, name, drafter) for name in RUNS}
    steps = []
    for frozen, distilled in zip(*(runs[name] for name in RUNS)):
        row = {"step": frozen["step"]}
        for name, r in (("frozen", frozen), ("distilled", distilled)):
            row.update({f"{name}_{k}": r.get(k) for k in PER_STEP})
        row.update({k: distilled.get(k) for k in ("drafter_tv_before", "drafter_tv_after")})
        steps.append(row)
    half = steps[len(steps) // 2 :]
    summary = {
        f"{name}_{k}_second_half": mean(r[f"{name}_{k}"] for r in half)
        for name in RUNS
        for k in ("spec_accept_len", "spec_draft_acceptance")
    }
    result = {
        "recipe": args.recipe,
        "drafter": str(drafter),
        "steps": steps,
        "summary": summary,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/bench_spec_rl.py", *(argv if argv is not None else sys.argv[1:])]),
    }

    print(f"\n{args.recipe}, drafter {drafter}; distilled every {args.distill_every} step(s)")
    print(
        "| step | accept len frozen | accept len distilled | acceptance frozen | acceptance distilled | "
        "verify tok frozen | verify tok distilled | drafter TV before -> after | reward frozen | reward distilled |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in steps:
        tv = "-" if r["drafter_tv_before"] is None else f"{fmt(r['drafter_tv_before'])} -> {fmt(r['drafter_tv_after'])}"
        print(
            f"| {r['step']} | {fmt(r['frozen_spec_accept_len'])} | {fmt(r['distilled_spec_accept_len'])} | "
            f"{fmt(r['frozen_spec_draft_acceptance'])} | {fmt(r['distilled_spec_draft_acceptance'])} | "
            f"{fmt(r['frozen_spec_verify_tokens'])} | {fmt(r['distilled_spec_verify_tokens'])} | {tv} | "
            f"{fmt(r['frozen_reward_mean'])} | {fmt(r['distilled_reward_mean'])} |"
        )
    print(
        "second half of the run, mean accepted length: frozen {} / distilled {}; draft acceptance: frozen {} / "
        "distilled {}".format(
            *(fmt(summary[f"{n}_{k}_second_half"]) for k in ("spec_accept_len", "spec_draft_acceptance") for n in RUNS)
        )
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
