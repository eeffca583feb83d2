"""The trainer's parallel layouts (and the engine's, `rollout.tp`) through `miles-train`, each against one rank:
first-step loss and gradient norm, step time, samples/s, per-GPU peak memory, the adapter sync's time and
bytes, each phase's memory, and scaling efficiency at the same global batch.

    python scripts/bench_layouts.py --recipe k3_small_gpu --layouts single,tp2,pp2,cp2,ep2,dp2 --json layouts.json
    python scripts/bench_layouts.py --layouts single,tp2 --set rollout.prompts_per_step=4   # the CPU check

Each layout is one `miles-train` run of `--steps` GRPO steps (local launcher: one process per rank, nccl on
CUDA, gloo on CPU), deterministic, without evaluations or checkpoints, in its own run directory under
`--work-dir`; the figures come from its metrics.jsonl. Step 1 samples the same untrained adapter in every
layout, so its rewards must be the single rank's and its loss and gradient norm agree up to reduction order
(fp32 on CPU; bf16 on a GPU, where the tolerance printed is the caller's to judge). Times are the last step's
(the first compiles, autotunes and captures graphs). Scaling efficiency is t(single) / (ranks x t(layout)) at
the same global batch: 1.0 means the ranks divided the step's time perfectly. A run that fails is a row with
its last error line, and the next layout runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# name -> (the layout's overrides, processes): the recipes/parallel presets, and PP=2 x EP=2 on four ranks
LAYOUTS = {
    "single": ([], 1),
    "tp2": (["parallel=tp2"], 2),
    "sp2": (["parallel=tp2", "parallel.sp=true"], 2),
    "dp2": (["parallel=dp2"], 2),
    "pp2": (["parallel=pp2"], 2),
    "ep2": (["parallel=ep2"], 2),
    "cp2": (["parallel=cp2"], 2),
    "tp2_pp2": (["parallel=tp2_pp2"], 4),
    "pp2_ep2": (["parallel=pp2", "parallel.ep=2", "parallel.dp=2"], 4),
    # the engine's own layout in the loop (every rank one shard of a replica; the adapter synced shard to shard)
    "tp2_etp2": (["parallel=tp2", "rollout.tp=2"], 2),
    "pp2_etp2": (["parallel=pp2", "rollout.tp=2"], 2),
    "ep2_etp2": (["parallel=ep2", "rollout.tp=2", "rollout.ep=true"], 2),
    "tp2_pp2_etp4": (["parallel=tp2_pp2", "rollout.tp=4"], 4),
}
RUN = [
    "trainer.eval_before=false",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.deterministic=true",
    "logging.wandb=disabled",
    "logging.progress=false",
]


def names_from(known) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of `known` (else an error naming the unknown ones)."""

    def parse(value: str) -> list[str]:
        names = value.split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; known: {', '.join(known)}")
        return names

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="k3_grpo", help="a recipes/recipe name (k3_small_gpu on a GPU)")
    ap.add_argument(
        "--layouts", type=names_from(LAYOUTS), default="single,tp2", help=f"comma-separated, from {', '.join(LAYOUTS)}"
    )
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps a run (the last one is timed)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override for every run (repeatable)"
    )
    ap.add_argument("--work-dir", type=Path, default=Path("runs/layouts"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds a run may take")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    return args


def run_layout(name: str, args: argparse.Namespace) -> dict:
    """One `miles-train` run of the layout: its step-1 and last-step figures, or its failure."""
    overrides, ranks = LAYOUTS[name]
    run_dir = args.work_dir / name
    cmd = [
        sys.executable,
        "-m",
        "miles_k3.cli.train",
        f"recipe={args.recipe}",
        *overrides,
        f"cluster.num_workers={ranks}",
        f"trainer.max_steps={args.steps}",
        *RUN,
        *args.set,
        f"hydra.run.dir={run_dir}",
    ]
    start = time.perf_counter()
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout, env={**os.environ, "WANDB_SILENT": "true"}
        )
        lines = [ln for ln in out.stderr.strip().splitlines() if ln and "HYDRA_FULL_ERROR" not in ln]
        failed = out.returncode != 0 and (lines or [f"exit {out.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        failed = f"timed out after {args.timeout} s"
    row = dict(layout=name, ranks=ranks, wall_s=round(time.perf_counter() - start, 1))
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [s for s in steps if "loss" in s]  # training rows (evaluations have none)
    if failed or not steps:
        return {**row, "status": f"failed: {failed or 'no training step logged'}"}
    first, last = steps[0], steps[-1]
    return {
        **row,
        "status": "ok",
        "reward_mean": first.get("reward_mean"),
        "loss": first["loss"],
        "grad_norm": first.get("grad_norm"),
        "step_s": last["step_s"],
        "train_s": last["train_s"],
        "rollout_s": last["rollout_s"],
        "samples_per_s": last["samples_per_s"],
        "peak_gib": last.get("train_peak_gib"),
        "sync_ms": last.get("adapter_sync_ms"),
        "sync_received_bytes_max": last.get("adapter_sync_received_bytes_max"),
        "rollout_phase_gib": (last.get("memory_rollout_bytes_max") or 0) / 2**30,
        "train_phase_gib": (last.get("memory_train_bytes_max") or 0) / 2**30,
    }


def against(rows: list[dict]) -> None:
    """Each row's agreement with the single rank's step 1 and its scaling efficiency (in place)."""
    one = next((r for r in rows if r["layout"] == "single" and r["status"] == "ok"), None)
    for r in rows:
        if one is None or r["status"] != "ok":
            continue
        r["same_rewards"] = r["reward_mean"] == one["reward_mean"]
        r["loss_diff"] = abs(r["loss"] - one["loss"])
        if r["grad_norm"] is not None and one["grad_norm"]:
            r["grad_norm_rel_diff"] = abs(r["grad_norm"] - one["grad_norm"]) / one["grad_norm"]
        r["scaling_efficiency"] = one["step_s"] / (r["ranks"] * r["step_s"])


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    for name in args.layouts:
        rows.append(run_layout(name, args))
        print(json.dumps(rows[-1]), flush=True)
    against(rows)
    head = (
        "layout",
        "ranks",
        "status",
        "loss",
        "loss_diff",
        "grad_norm",
        "grad_norm_rel_diff",
        "same_rewards",
        "step_s",
        "train_s",
        "rollout_s",
        "samples_per_s",
        "peak_gib",
        "scaling_efficiency",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r.get(h) for h in head]
        print(
            "| "
            + " | ".join("-" if c is None else f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells)
            + " |"
        )
    if args.json:
        meta = dict(
            recipe=args.recipe,
            steps=args.steps,
            overrides=args.set,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            command=" ".join(["python", "scripts/bench_layouts.py", *(argv if argv is not None else sys.argv[1:])]),
        )
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
