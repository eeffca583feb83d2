"""What exact mode costs: the same GRPO run through the real `miles-train`, once in the builds' own orders and
once with `rollout.exact=true`. Prints, per arm, the train/rollout |d logp| (mean and max) and k3 KL, the
rollout, train and step seconds and samples per second (means over the steps after the first, which pays the
one-time set-up), and exact's cost as a ratio to the plain arm; writes the rows as JSON.

    python scripts/bench_exact.py --steps 5                                  # CPU, the embedded K3
    python scripts/bench_exact.py --recipe k3_small_gpu --steps 10 --json exact.json \\
        rollout.quantize=none rollout.dtype=bfloat16 rollout.cuda_graphs=false       # bf16 on a GPU

Extra arguments are `miles-train` overrides for both arms (exact mode's rules: one model replica per rank, the
engine's base equal to the trainer's). The plain arm runs under the same overrides, so the ratio is exact
mode's own cost. `--reuse` keeps an arm whose metrics.jsonl is complete.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_routing import run_arm, summarize  # scripts/ is on the path when run as a script

MEANS = (
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_abs_diff_max",
    "train_rollout_kl",
    "rollout_s",
    "train_s",
    "step_s",
    "samples_per_s",
)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="k3_grpo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--work-dir", default="outputs/bench_exact")
    parser.add_argument("--reuse", action="store_true", help="keep an arm whose run finished")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("overrides", nargs="*", help="miles-train overrides for both arms")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    rows = []
    for exact in (False, True):
        run_dir = run_arm(f"exact_{str(exact).lower()}", [f"rollout.exact={str(exact).lower()}"], args, work)
        rows.append(summarize({"exact": exact}, run_dir, MEANS, skip_first=True))
    plain, exact_row = rows
    for name in ("rollout_s", "train_s", "step_s"):
        exact_row[f"{name}_ratio"] = exact_row[name] / plain[name]
    print(
        f"{'exact':>6} {'|dlogp|':>9} {'max':>9} {'k3 KL':>9} {'rollout s':>10} {'train s':>8} {'step s':>7} "
        f"{'samples/s':>10} {'step x':>7}"
    )
    for r in rows:
        ratio = r.get("step_s_ratio", 1.0)
        print(
            f"{str(r['exact']):>6} {r['train_rollout_logprob_abs_diff']:9.2e} "
            f"{r['train_rollout_logprob_abs_diff_max']:9.2e} {r['train_rollout_kl']:9.2e} {r['rollout_s']:10.2f} "
            f"{r['train_s']:8.2f} {r['step_s']:7.2f} {r['samples_per_s']:10.1f} {ratio:7.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
