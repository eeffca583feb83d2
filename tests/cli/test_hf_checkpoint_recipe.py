"""`model=hf_checkpoint`: a user's own HF checkpoint (config.json, safetensors, a transformers tokenizer)
runs a GRPO step through the real CLI (a subprocess, as a user runs it)."""

import json
import os
import subprocess
import sys

from tests.cli.fixtures import spaced_arithmetic, write_checkpoint, write_prompts


def test_one_step_on_a_saved_checkpoint_with_its_tokenizer(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    data = write_prompts(tmp_path / "prompts.jsonl", spaced_arithmetic(8))
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "miles_k3.cli.train",
        "model=hf_checkpoint",
        f"model.path={ckpt}",
        f"data.path={data}",
        "data.eval_path=null",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=3",
        "algo.dynamic_sampling=false",
        "trainer.max_steps=1",
        "logging.wandb=disabled",
        "logging.progress=false",
        "cluster.threads_per_worker=1",
        f"hydra.run.dir={run}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["groups_kept"] == 2 and 0.0 <= row["reward_mean"] <= 1.0
    assert row["train_rollout_logprob_abs_diff"] < 1e-4  # engine and trainer: the same checkpoint
    assert (run / "checkpoints" / "step_00000001" / "adapter" / "adapter_config.json").is_file()
