"""Speculation in the GRPO loop (rollout.speculative): its settings fail by field name before anything is
built and take SpecConfig's / DistillConfig's defaults; the rollout worker's distillation target is the
policy with its adapter, and the drafter it trains in place keeps speculation lossless; a run writes the
speculation and distillation metrics, and the train-vs-rollout log-prob agreement is the same with
speculation as without."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_k3.trainer.base import build_tokenizer, load_base
from miles_k3.trainer.config import SpeculativeCfg
from miles_k3.trainer.resolve import resolve
from miles_k3.trainer.rollout_worker import ADAPTER
from miles_k3.trainer.workers import build_rollout_worker
from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.distill import DistillConfig
from tests.trainer.recipes import composed, fresh, random_drafter


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A random DSpark drafter for the embedded base."""
    return random_drafter(tmp_path_factory.mktemp("drafter"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.speculative.drafter=/no/such/dir"], r"^rollout\.speculative\.drafter must be a DSpark drafter "),
        (["rollout.speculative.distill_every=2"], r"^rollout\.speculative\.distill_every needs rollout\.speculative"),
        (["DRAFTER", "rollout.speculative.gamma=0"], r"^rollout\.speculative\.gamma must be an integer >= 1"),
        (
            ["DRAFTER", "rollout.speculative.gamma=5"],
            r"^rollout\.speculative\.gamma must be <= the drafter's block_size",
        ),
        (["DRAFTER", "rollout.speculative.planner=best"], r"^rollout\.speculative\.planner must be one of"),
        (["DRAFTER", "rollout.speculative.max_batch=0"], r"^rollout\.speculative\.max_batch must be an integer >= 1"),
        (
            ["DRAFTER", "rollout.speculative.distill_every=-1"],
            r"^rollout\.speculative\.distill_every must be an integer",
        ),
        (["rollout.speculative.distill_lr=0"], r"^rollout\.speculative\.distill_lr must be > 0"),
        (["DRAFTER", "rollout.offload_weights=true"], r"^rollout\.offload_weights with rollout\.speculative\.drafter"),
        (["rollout.speculative.distill_decay=2"], r"^rollout\.speculative\.distill_decay must be <= 1"),
        (["rollout.speculative.distill_steps=0"], r"^rollout\.speculative\.distill_steps must be an integer >= 1"),
        (
            ["DRAFTER", "rollout.speculative.distill_every=2", "rollout.tp=2", "parallel=tp2", "cluster.num_workers=2"],
            r"^rollout\.speculative\.distill_every distils the drafter of a one-rank engine: needs "
            r"rollout\.tp=1, got 2$",
        ),
    ],
)
def test_bad_speculative_settings_fail_by_field_name(drafter_dir, overrides, message):
    overrides = [f"rollout.speculative.drafter={drafter_dir}" if o == "DRAFTER" else o for o in overrides]
    with pytest.raises(ValueError, match=message) as e:
        resolve(composed(*overrides))
    assert "\n" not in str(e.value)


def test_speculation_is_off_by_default_and_takes_its_components_defaults(drafter_dir):
    assert resolve(composed()).engine.speculation is None
    spec = resolve(composed(f"rollout.speculative.drafter={drafter_dir}")).engine.speculation
    assert isinstance(spec, SpecConfig) and spec.drafter == str(drafter_dir)
    assert (spec.gamma, spec.planner, spec.max_batch) == (SpecConfig.gamma, SpecConfig.planner, SpecConfig.max_batch)
    cfg = SpeculativeCfg()
    assert cfg.distill() == DistillConfig()
    assert (cfg.gamma, cfg.planner, cfg.max_batch) == (SpecConfig.gamma, SpecConfig.planner, SpecConfig.max_batch)
    gated = resolve(composed(f"rollout.speculative.drafter={drafter_dir}", "rollout.speculative.max_batch=32"))
    assert gated.engine.speculation.max_batch == 32


@pytest.fixture(scope="module")
def workers(drafter_dir):
    """A speculating and a plain rollout worker on the embedded base, both holding one non-zero adapter."""
    rc = resolve(composed(f"rollout.speculative.drafter={drafter_dir}"))
    config, state = load_base(rc.model, 0)
    spec_w = build_rollout_worker(rc, config, state, "cpu")
    plain_w = build_rollout_worker(resolve(composed()), config, state, "cpu")
    pool = plain_w.engine.adapters
    g = torch.Generator().manual_seed(0)
    tensors = {f"{m}.lora_A": 0.05 * torch.randn(a.shape[1:], generator=g) for m, a in pool.A.items()}
    tensors.update({f"{m}.lora_B": 0.05 * torch.randn(b.shape[1:], generator=g) for m, b in pool.B.items()})
    for w in (spec_w, plain_w):
        w.sync_adapter(tensors)
    return spec_w, plain_w, build_tokenizer(rc.model, config)


def test_the_distillation_target_is_the_policy_with_its_adapter(workers):
    """Per sampled token, the target distribution the worker distils toward gives the log-prob the engine
    reported for it (temperature 1): the policy with its adapter, not the bare base."""
    spec_w, _, tok = workers
    prompts = [tok.encode_prompt(p) for p in ("12+7=", "40-9=", "3+3=")]
    params = [SamplingParams(max_new_tokens=8, stop_token_ids=(tok.eos_token_id,), seed=i) for i in range(3)]
    gens = spec_w.generate(fresh(prompts), params)
    seqs = [(len(p), p + g.output_ids) for p, g in zip(prompts, gens)]
    examples = [(s, p) for s, (plen, t) in enumerate(seqs) for p in range(plen, len(t) - 1)]
    blocks = spec_w.policy_blocks(seqs, examples, spec_w.engine.decoder.strategy.drafter.config)
    for i, (s, p) in enumerate(examples):
        k = p + 1 - seqs[s][0]  # the response token the block's first position predicts
        ours = float(blocks.probs[i, 0, blocks.tokens[i, 0]].log())
        assert abs(ours - gens[s].logprobs[k]) < 1e-4


def test_distill_drafter_updates_the_engines_drafter_in_place_and_stays_lossless(workers):
    spec_w, plain_w, tok = workers
    prompts = [tok.encode_prompt(p) for p in ("12+7=", "40-9=", "77-70=", "8-15=")]
    greedy = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(tok.eos_token_id,))
    want = plain_w.generate(fresh(prompts), [greedy] * 4)

    def check_lossless():
        for a, b in zip(want, spec_w.generate(fresh(prompts), [greedy] * 4)):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4

    check_lossless()
    drafter = spec_w.engine.decoder.strategy.drafter
    ptrs = {n: p.data_ptr() for n, p in drafter.named_parameters()}
    fc = drafter.fc.weight.detach().clone()
    sampled = [SamplingParams(max_new_tokens=10, stop_token_ids=(tok.eos_token_id,), seed=i) for i in range(8)]
    gens = spec_w.generate(fresh(prompts * 2), sampled)
    seqs = [(len(p), p + g.output_ids) for p, g in zip(prompts * 2, gens)]
    out = spec_w.distill_drafter(seqs, DistillConfig(steps=2, blocks=16), seed=0)
    assert set(out) == {
        "drafter_tv_before",
        "drafter_tv_after",
        "drafter_distill_loss",
        "drafter_distill_blocks",
        "drafter_distill_ms",
    }
    assert spec_w.engine.decoder.strategy.drafter is drafter
    assert {n: p.data_ptr() for n, p in drafter.named_parameters()} == ptrs
    assert not torch.equal(drafter.fc.weight.detach(), fc)
    check_lossless()
    counters = spec_w.engine_counters()
    assert counters["spec_emitted"] >= counters["spec_rows"] > 0 and counters["spec_verify_steps"] > 0
    with pytest.raises(ValueError, match="distill_drafter needs an engine speculating"):
        plain_w.distill_drafter(seqs, DistillConfig(), seed=0)
    assert ADAPTER in spec_w.engine.adapters.names


SMALL = [
    "recipe=k3_grpo",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "trainer.eval_before=false",
    "trainer.eval_every=0",
    "data.eval_max_prompts=4",
    "logging.progress=false",
    "logging.wandb=disabled",
    "cluster.threads_per_worker=1",
]


def run(run_dir: Path, *overrides, steps: int = 2, save_every: int = 0) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "miles_k3.cli.train",
        *SMALL,
        f"trainer.max_steps={steps}",
        f"trainer.save_every={save_every}",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_loop_writes_speculation_metrics_and_agreement_is_unchanged(tmp_path, drafter_dir):
    """Same seed and settings, with and without speculation (and a distillation every step): each step's
    row holds the speculation and distillation metrics, and the engine's sampled log-probs agree with the
    trainer's recomputation as closely as without speculation."""
    plain = [r for r in run(tmp_path / "plain") if "reward_mean" in r]
    spec = [
        r
        for r in run(
            tmp_path / "spec",
            f"rollout.speculative.drafter={drafter_dir}",
            "rollout.speculative.distill_every=1",
            "rollout.speculative.distill_steps=2",
        )
        if "reward_mean" in r
    ]
    assert [r["step"] for r in spec] == [1, 2]
    for p, s in zip(plain, spec):
        assert "spec_accept_len" not in p
        assert 1.0 <= s["spec_accept_len"] <= 5.0 and 0.0 <= s["spec_draft_acceptance"] <= 1.0
        assert s["spec_verify_tokens"] == s["rollout_spec_rows"] + s["rollout_spec_drafted"] > 0
        assert s["spec_accept_len"] == pytest.approx(s["rollout_spec_emitted"] / s["rollout_spec_rows"])
        assert s["drafter_distill_blocks"] > 0 and s["drafter_tv_after"] >= 0.0
    # a step without a group of reward variance trains nothing (and has no agreement to report)
    agree = [
        [r["train_rollout_logprob_abs_diff"] for r in rs if "train_rollout_logprob_abs_diff" in r]
        for rs in (plain, spec)
    ]
    assert agree[0] and agree[1]
    assert max(agree[0]) < 1e-5 and max(agree[1]) < 1e-5
    assert abs(max(agree[0]) - max(agree[1])) < 2e-6


def test_a_resumed_run_continues_with_the_distilled_drafter_and_its_optimizer(tmp_path, drafter_dir):
    """The checkpoint keeps the distilled drafter (it decides which tokens a seeded sample draws): a run
    stopped after step 2 and resumed reproduces step 3 of the uninterrupted run."""
    spec = [
        f"rollout.speculative.drafter={drafter_dir}",
        "rollout.speculative.distill_every=1",
        "rollout.speculative.distill_steps=2",
    ]
    whole = run(tmp_path / "whole", *spec, steps=3, save_every=1)
    run(tmp_path / "split", *spec, steps=2, save_every=1)
    assert (tmp_path / "split" / "checkpoints" / "step_00000002" / "drafter_state.pt").is_file()
    resumed = run(tmp_path / "split", *spec, steps=3, save_every=1)
    timing = {"rollout_s", "train_s", "step_s", "samples_per_s", "adapter_sync_ms", "drafter_distill_ms"}

    def stable(r):
        return {k: v for k, v in r.items() if k not in timing}

    last = [r for r in whole if r["step"] == 3 and "reward_mean" in r]
    again = [r for r in resumed if r["step"] == 3 and "reward_mean" in r]
    assert stable(again[0]) == stable(last[0])
