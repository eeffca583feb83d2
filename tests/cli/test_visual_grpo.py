"""`miles-train recipe=k3_grpo_squares`: the visual GRPO recipe on the shipped vision-language base
(k3-tiny-vl-squares) through the real CLI (a subprocess, as a user runs it), shortened to 2 steps: pictures
from the prompt files reach the rollouts and the trainer, the squares reward scores them, and the trainer's
log-probs equal the engine's (the features reach both the same way)."""

import json
import os
import subprocess
import sys

SMALL = [
    "recipe=k3_grpo_squares",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "trainer.max_steps=2",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "data.eval_max_prompts=16",
    "logging.wandb=disabled",
    "logging.progress=false",
    "cluster.threads_per_worker=1",
]


def test_two_steps_of_the_visual_recipe(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles_k3.cli.train", *SMALL, f"hydra.run.dir={run}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    for r in (rows[0], rows[3]):  # greedy evaluations on the held-out pictures
        assert r["eval_samples"] == 16 and 0.0 <= r["eval_accuracy"] <= 1.0
    assert rows[0]["eval_accuracy"] > 0.0  # the pretrained base counts some pictures right from the start
    trained = [r for r in rows[1:3] if r["groups_kept"] > 0]
    assert trained, "no step had a group with reward variance: nothing was trained"
    for r in rows[1:3]:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["reward_failures_exception"] == 0
        assert r["response_len_mean"] <= 4  # rollout.max_new_tokens of the recipe
    for r in trained:
        assert r["train_rollout_logprob_abs_diff"] < 1e-4  # fp32 on CPU: the same model on both sides
    assert (run / "checkpoints" / "step_00000002" / "adapter" / "adapter_config.json").is_file()
