"""Hydra composition of the shipped recipes and whole-config validation (errors name the field)."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from miles_k3.trainer.base import load_base_config
from miles_k3.trainer.config import register_schema, resolve


def composed(*overrides):
    register_schema()
    with initialize_config_module(config_module="recipes", version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def test_default_recipe_resolves_to_the_embedded_run():
    rc = resolve(composed("recipe=k3_grpo"))
    assert rc.model.path.endswith("k3-tiny-arith") and rc.reward.fn == "arithmetic"
    assert rc.data.path.endswith("train.jsonl") and rc.eval_data.path.endswith("heldout.jsonl")
    assert rc.loss.rollout_correction == "tis" and rc.loss.eps_high == 0.28
    assert rc.lora.rank == 8 and rc.engine.memory_bytes == 64 << 20


def test_groups_swap_and_interpolate():
    rc = resolve(composed("recipe=k3_grpo", "algo=dr_grpo", "rollout.max_new_tokens=7"))
    assert rc.loss.reducer == "dr_grpo" and rc.loss.max_response_len == 7 and rc.loss.kl == "k3"
    assert resolve(composed("recipe=k3_grpo", "parallel=tp2", "parallel.sp=true", "cluster.num_workers=2")).parallel.sp
    rc = resolve(composed("recipe=k3_grpo", "model=k3_small", "cluster=gpu_single"))
    assert rc.model.preset == "k3-small" and rc.model.path is None and rc.cluster.device == "cuda"
    rc = resolve(composed("recipe=k3_small_gpu"))
    assert resolve(composed("recipe=k3_small_gpu", "rollout.mxfp4_matmul=triton")).engine.mxfp4_matmul == "triton"
    with pytest.raises(ValueError, match="rollout.mxfp4_matmul 'triton' needs cluster.device=cuda"):
        resolve(composed("recipe=k3_small_gpu", "rollout.mxfp4_matmul=triton", "cluster=local_cpu"))
    assert rc.model.train_dtype == "bfloat16" and rc.rollout.quantize == "experts" and rc.lora.rank == 16
    config = load_base_config(rc.model)  # k3-small at the task's 32-id vocabulary takes the task's special ids
    assert (config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id) == (32, 0, 1, 2)
    assert rc.raw["algo"]["dynamic_sampling"] is False  # random init: every group has zero reward variance
    assert rc.engine.max_prefill_requests == 256 and rc.raw["rollout"]["release_memory"] is False


@pytest.mark.parametrize("override, field", [
    ("algo.eps_low=1.5", "algo: PolicyLossConfig.eps_low"),
    ("algo.kl=k9", "algo: PolicyLossConfig.kl"),
    ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt"),
    ("rollout.quantize=int3", "rollout.quantize"),
    ("rollout.mxfp4_matmul=cutlass", "rollout.mxfp4_matmul"),
    ("rollout.overlap=yes", "rollout.overlap"),
    ("rollout.compile_decode=true", "rollout.compile_decode compiles the CUDA-graph decode step"),
    ("rollout.mxfp4_matmul=triton", "rollout.mxfp4_matmul 'triton' needs rollout.quantize"),  # quantize none
    ("rollout.chunk_size=24", "rollout: chunk_size"),
    ("rollout.max_prefill_requests=0", "rollout.max_prefill_requests"),
    ("optim.lr=0", "optim.lr"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.resume=/no/such/dir", "trainer.resume"),
    ("parallel.pp=2", "parallel.pp"),
    ("parallel.sp=true", "parallel.sp needs parallel.tp > 1"),
    ("parallel.tp=2", "cluster.num_workers"),
    ("cluster.device=tpu", "cluster.device"),
    ("reward.on_failure=ignore", "reward: RewardConfig.on_failure"),
    ("reward.url=http://x", "reward: RewardConfig.url"),
    ("data.path=/no/such.jsonl", "data.path"),
    ("data.path=prompts.csv", "data: path"),
    ("model.path=/no/such/model", "model.path"),
    ("model.preset=k3-small", "model: set exactly one"),
    ("lora.rank=0", "lora:"),
    ("logging.wandb=cloud", "logging.wandb"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ValueError) as e:
        resolve(composed("recipe=k3_grpo", override))
    assert str(e.value).startswith(field), str(e.value)


def test_unknown_key_and_wrong_type_fail_at_composition():
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        composed("recipe=k3_grpo", "trainer.max_stepz=3")
    assert "max_stepz" in str(e.value)
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        composed("recipe=k3_grpo", "trainer.max_steps=many")
    assert "max_steps" in str(e.value)


def test_resolve_accepts_a_plain_mapping_and_reports_bad_types():
    cfg = OmegaConf.create({"trainer": {"max_steps": "x"}})
    with pytest.raises(ValueError, match="max_steps"):
        resolve(cfg)


def test_cli_prints_the_resolved_config_and_rejects_bad_ones(tmp_path):
    out = subprocess.run([sys.executable, "-m", "miles_k3.cli.train", "recipe=k3_grpo", "--cfg", "job"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "recipe: k3_grpo" in out.stdout and "samples_per_prompt: 8" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "miles_k3.cli.train", "recipe=k3_grpo", "algo.eps_high=-1",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert bad.returncode == 2
    assert "config error: algo: PolicyLossConfig.eps_high" in bad.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
