"""rollout.exact: the trainer's log-probs of the sampled tokens equal the engine's bit for bit, through the real
`miles-train` (prefix sharing within groups, retraction under a tight pool, the overlap schedule and
speculation all on), against a control run without it whose gap is not 0; its config rules fail by field.
Exact mode's ops on their own: tests/ops/test_exact.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_k3.ops import exact
from miles_k3.trainer.resolve import resolve
from tests.trainer.recipes import composed, random_drafter

RUN = [
    "recipe=k3_grpo",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",  # a group's followers take the prompt from the first one's pages
    "trainer.max_steps=5",
    "trainer.save_every=0",
    "trainer.eval_every=0",
    "trainer.eval_before=false",
    "logging.progress=false",
    "cluster.threads_per_worker=1",
    "rollout.overlap=on",
    "rollout.memory_mb=1",
    "rollout.state_fraction=0.95",  # 11 state slots, 8 KV pages: requests retract and are recomputed
]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("drafter"))


def train(run_dir, *overrides):
    cmd = [sys.executable, "-m", "miles_k3.cli.train", *RUN, *overrides, f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train_rollout_logprob_abs_diff" in r]


def test_exact_mode_trains_the_sampled_log_probs_bit_for_bit(tmp_path, drafter_dir):
    spec = f"rollout.speculative.drafter={drafter_dir}"
    rows = train(tmp_path / "exact", "rollout.exact=true", spec)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["train_rollout_logprob_abs_diff"] == 0.0 and r["train_rollout_logprob_abs_diff_max"] == 0.0, r
    assert sum(r["rollout_retractions"] for r in rows) > 0  # the recomputed requests are exact too
    assert all(r["spec_verify_tokens"] > 0 for r in rows)  # every token came out of a verify forward
    control = train(tmp_path / "plain", spec)  # the same run in the builds' own orders
    assert max(r["train_rollout_logprob_abs_diff_max"] for r in control) > 0.0
    assert [r["rollout_retractions"] for r in control] == [r["rollout_retractions"] for r in rows]


def check_prefix_hits_and_an_updated_adapter_are_exact():
    """Worker level, in a process started with exact.CPU_ENV: the group's later samples take the prompt from
    the prefix cache (cached_tokens > 0), and after an update the engine's log-probs equal the trainer's."""
    from megatron_patches.parallel import ensure_parallel
    from miles_k3.trainer.base import build_tokenizer, load_base
    from miles_k3.trainer.batch import TrainBatch
    from miles_k3.trainer.rollout_worker import ADAPTER
    from miles_k3.trainer.workers import build_rollout_worker, build_train_worker
    from rollout.request import SamplingParams

    ensure_parallel()
    rc = resolve(composed("optim.lr=5e-2", "rollout.exact=true"))
    config, state = load_base(rc.model, 0)
    tok = build_tokenizer(rc.model, config)
    with exact.numerics():
        trainer = build_train_worker(rc, config, state, "cpu")
        engine = build_rollout_worker(rc, config, state, "cpu")

        def rollouts(seed):
            # past one KDA checkpoint (chunk_size 64): the followers' prompts are cache hits
            long = ["+".join(str(i % 10) for i in range(40 + j)) + "=" for j in range(3)]
            prompts = [tok.encode_prompt(p) for p in long for _ in range(3)]
            params = [
                SamplingParams(max_new_tokens=6, stop_token_ids=(tok.eos_token_id,), seed=seed + i)
                for i in range(len(prompts))
            ]
            outs = engine.engine.generate(prompts, params, adapter=ADAPTER)  # Completions: with cached_tokens
            advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
            groups = [i // 3 for i in range(len(prompts))]
            batch = TrainBatch.of(prompts, [o.output_ids for o in outs], [o.logprobs for o in outs], advantages, groups)
            return batch, outs

        engine.sync_adapter(trainer.adapter_state())
        for seed in (0, 100):
            batch, outs = rollouts(seed)
            assert sum(o.cached_tokens for o in outs) > 0
            got = trainer.logprobs(batch)
            assert got == batch.rollout_logprobs  # Python floats: equal bits
            trainer.train(batch)  # a non-zero adapter for the second round
            engine.sync_adapter(trainer.adapter_state())


def test_prefix_hits_and_an_updated_adapter_are_exact():
    code = "import tests.trainer.test_exact_mode as t; t.check_prefix_hits_and_an_updated_adapter_are_exact()"
    env = {**os.environ, **exact.CPU_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize(
    "overrides, need",
    [
        (["parallel=tp2", "cluster.num_workers=2"], "parallel.tp, pp, cp and ep = 1"),
        (["rollout.tp=2", "cluster.num_workers=2", "parallel.dp=2"], "rollout.tp=1"),
        (["rollout.quantize=experts"], "rollout.quantize=none"),
        (["rollout.dtype=bfloat16"], "rollout.dtype equal to model.train_dtype (float32)"),
        (["lora.dropout=0.1"], "lora.dropout=0"),
        (["rollout.backend=http", "rollout.urls=[http://127.0.0.1:1]"], "rollout.backend=colocated"),
        (["rollout.fn=miles_k3.tasks.arithmetic:rollout"], "no rollout.fn"),
    ],
)
def test_exact_mode_rules_fail_by_field(overrides, need):
    with pytest.raises(ValueError) as e:
        resolve(composed("rollout.exact=true", *overrides))
    assert str(e.value).startswith(f"rollout.exact needs {need}"), str(e.value)
    assert "\n" not in str(e.value)


def test_an_external_world_on_cpu_must_start_with_the_environment(monkeypatch):
    if not exact.cpu_env_missing():
        pytest.skip("this process started with exact.CPU_ENV")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)  # a torchrun rank
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match=r"^rollout\.exact on CPU needs the ranks started with ATEN_CPU_CAPABILITY"):
        resolve(composed("rollout.exact=true", "cluster.launcher=external"))
