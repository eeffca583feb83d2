"""Multi-turn rollouts (rollout.fn): the loss mask through the batch and the loss (masked tokens are context, not
loss), the plugin contract (sync or async, checked samples, errors naming the function), and the
calculator tool-use example trained end to end through `miles-train` with both clients."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_k3.data import PromptRecord
from miles_k3.data.sample import Sample
from miles_k3.trainer.batch import TrainBatch, pack
from miles_k3.trainer.resolve import resolve
from miles_k3.trainer.rollout_plugin import (
    PolicyClient,
    RolloutJob,
    RolloutPluginError,
    load_rollout_fn,
    run_rollouts,
    turn,
)
from rollout.request import SamplingParams
from tests.trainer.recipes import composed

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "recipe=k3_grpo",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "trainer.max_steps=2",
    "trainer.save_every=0",
    "trainer.eval_every=0",
    "data.eval_max_prompts=8",
    "logging.progress=false",
    "logging.wandb=disabled",
    "cluster.threads_per_worker=1",
]
TIMING = {"rollout_s", "train_s", "step_s", "samples_per_s", "adapter_sync_ms"}


# ------------------------------------------------------------------ the batch
def test_pack_keeps_masked_tokens_in_the_row_and_out_of_the_loss_mask():
    b = TrainBatch.of(
        prompts=[[1, 5], [1, 7]],
        responses=[[8, 9, 10, 2], [11, 2]],
        rollout_logprobs=[[-0.1, 0.0, 0.0, -0.2], [-0.3, -0.4]],
        advantages=[1.0, -1.0],
        group_ids=[0, 0],
        loss_masks=[[True, False, False, True], [True, True]],
    )
    p = pack(b, "cpu")
    assert p.input_ids.tolist() == [[1, 5, 8, 9, 10, 2, 1, 7, 11, 2]]  # the tool's tokens are read as context
    assert p.targets.tolist() == [8, 9, 10, 2, 11, 2]
    assert p.mask().tolist() == [[True, False, False, True], [True, True, False, False]]
    assert p.policy_tokens == 4 and b.policy_tokens() == 4
    assert b.select([0]).loss_masks == [[True, False, False, True]]
    with pytest.raises(ValueError, match="policy token"):
        TrainBatch.of([[1]], [[2, 3]], [[0.0, 0.0]], [0.0], [0], loss_masks=[[False, False]])


@pytest.fixture(scope="module")
def tiny():
    from megatron_patches.parallel import ensure_parallel
    from miles_k3.trainer.base import build_tokenizer, load_base
    from miles_k3.trainer.workers import build_rollout_worker, build_train_worker

    ensure_parallel()
    rc = resolve(composed("optim.lr=1e-12", "optim.grad_clip=0"))  # grads measured, the adapter barely moves
    config, state = load_base(rc.model, 0)
    tok = build_tokenizer(rc.model, config)
    engine = build_rollout_worker(rc, config, state, "cpu")
    engine.sync_adapter(build_train_worker(rc, config, state, "cpu").adapter_state())
    prompts = [tok.encode_prompt(p) for p in ["12+7=", "40-9=", "3+3=", "77-70="] for _ in range(2)]
    params = [SamplingParams(max_new_tokens=5, seed=i) for i in range(len(prompts))]  # no eos stop: 5 tokens
    outs = engine.generate([Sample("", prompt_ids=p) for p in prompts], params)
    adv = torch.randn(len(prompts), generator=torch.Generator().manual_seed(0)).tolist()
    masks = [[True, False, False, True, True] for _ in prompts]  # tokens 1-2 "the tool's"
    batch = TrainBatch.of(
        prompts,
        [o.output_ids for o in outs],
        [o.logprobs for o in outs],
        adv,
        [i // 2 for i in range(len(prompts))],
        masks,
    )
    return rc, config, state, batch


def _grads(tiny, batch):
    from miles_k3.trainer.workers import build_train_worker

    rc, config, state, _ = tiny
    trainer = build_train_worker(rc, config, state, "cpu")
    seen, step = [], trainer.optimizer.step

    def step_seeing_grads(*args, **kwargs):  # the update frees its gradients after the step
        seen.append(torch.cat([p.grad.flatten() for p in trainer.params]))
        return step(*args, **kwargs)

    trainer.optimizer.step = step_seeing_grads
    metrics = trainer.train(batch)
    return seen[-1], metrics


def test_masked_tokens_carry_no_loss_and_flipping_the_mask_changes_the_gradient(tiny):
    batch = tiny[3]
    g, m = _grads(tiny, batch)
    assert g.abs().sum() > 0
    # the masked tokens' rollout log-probs (what a plugin puts there) reach neither the gradient nor the metrics
    junk = [
        [lp if keep else -7.0 for lp, keep in zip(lps, mask)]
        for lps, mask in zip(batch.rollout_logprobs, batch.loss_masks)
    ]
    g_junk, m_junk = _grads(
        tiny, TrainBatch.of(batch.prompts, batch.responses, junk, batch.advantages, batch.group_ids, batch.loss_masks)
    )
    assert torch.equal(g, g_junk)
    assert m["train_rollout_logprob_abs_diff"] == m_junk["train_rollout_logprob_abs_diff"] < 1e-5
    assert m["entropy"] == m_junk["entropy"]
    # the mask flipped (the tool's tokens the policy's, and the policy's the tool's, keeping one): another gradient
    flipped = [[not k for k in mask[:-1]] + [True] for mask in batch.loss_masks]
    g_flip, _ = _grads(
        tiny,
        TrainBatch.of(
            batch.prompts, batch.responses, batch.rollout_logprobs, batch.advantages, batch.group_ids, flipped
        ),
    )
    assert not torch.allclose(g, g_flip)
    # no mask: every token carries loss, as single-turn; equal to an all-True mask
    g_all, _ = _grads(
        tiny, TrainBatch.of(batch.prompts, batch.responses, batch.rollout_logprobs, batch.advantages, batch.group_ids)
    )
    g_true, _ = _grads(
        tiny,
        TrainBatch.of(
            batch.prompts,
            batch.responses,
            batch.rollout_logprobs,
            batch.advantages,
            batch.group_ids,
            [[True] * 5 for _ in batch.prompts],
        ),
    )
    assert torch.equal(g_all, g_true) and not torch.allclose(g_all, g)


# ------------------------------------------------------------ the plugin contract
class FakeClient(PolicyClient):
    """Answers every turn with `[7, 8]` and log-probs -0.5, after a short await."""

    async def _generate(self, ids, params):
        await asyncio.sleep(0)
        return turn(ids, [7, 8], [-0.5, -0.5], "stop")


class Codec:
    encode = staticmethod(lambda text: [3] * len(text))
    encode_prompt = staticmethod(lambda text: [1] + [3] * len(text))
    decode = staticmethod(lambda ids: "x" * len(ids))
    eos_token_id = 2


def _jobs(n):
    rec = PromptRecord(0, "1+1=", "1+1=", 2)
    return [
        RolloutJob(rec, Sample(rec.prompt, sample_index=i, prompt_ids=[1, 4, 13, 4, 16]), SamplingParams(seed=i))
        for i in range(n)
    ]


def _run(fn, jobs):
    plugin = load_rollout_fn(fn) if isinstance(fn, str) else fn
    return asyncio.run(run_rollouts(plugin, jobs, lambda job, loop: FakeClient(job, Codec(), loop), vocab_size=32))


async def async_tool_rollout(client, record):
    traj = client.sample
    traj.add_policy(await client.generate(traj.ids))
    traj.add_environment(client.encode("42"))
    traj.add_policy(await client.generate(traj.ids, max_new_tokens=2))
    return traj


def sync_tool_rollout(client, record):
    traj = client.sample
    traj.add_policy(client.generate_sync(traj.ids))
    traj.add_environment(client.encode("42"))
    return traj


def bad_logprob_rollout(client, record):
    s = client.sample
    s.output_ids, s.loss_mask, s.logprobs = [7], [True], [float("nan")]
    return s


def raising_rollout(client, record):
    raise KeyError("tool missing")


def not_a_sample(client, record):
    return {"ids": []}


def another_sample(client, record):
    return Sample(record.prompt, prompt_ids=list(client.prompt_ids))


def one_argument(client):
    return None


def all_masked_rollout(client, record):
    """Even samples: a real turn; odd ones: tool output only (no token of the policy's)."""
    traj = client.sample
    if traj.sample_index % 2:
        traj.add_environment(client.encode(" 1"))
    else:
        traj.add_policy(client.generate_sync(traj.ids))
    return traj


@pytest.mark.parametrize(
    "fn", ["tests.trainer.test_multi_turn:async_tool_rollout", "tests.trainer.test_multi_turn:sync_tool_rollout"]
)
def test_sync_and_async_plugins_return_masked_samples(fn):
    jobs = _jobs(3)
    trajs = _run(fn, jobs)
    assert len(trajs) == 3 and all(t is job.sample for t, job in zip(trajs, jobs))  # the driver's own records
    for t in trajs:
        assert t.prompt_ids == [1, 4, 13, 4, 16]
        n = len(t.output_ids)
        assert t.loss_mask[:4] == [True, True, False, False] and len(t.logprobs) == n == len(t.loss_mask)
        assert t.logprobs[:4] == [-0.5, -0.5, 0.0, 0.0]


def test_client_seeds_each_turn_and_adds_stop_tokens():
    job = _jobs(1)[0]
    client = FakeClient(job, Codec(), None)
    first = client._params(None, (16,))
    second = client._params(3, ())
    assert first.stop_token_ids == (16,) and first.max_new_tokens == job.params.max_new_tokens
    assert second.max_new_tokens == 3 and first.seed != second.seed and first.seed is not None


@pytest.mark.parametrize(
    "fn, match",
    [
        ("tests.trainer.test_multi_turn:bad_logprob_rollout", "group 0 sample 0: invalid sample: a policy token's"),
        ("tests.trainer.test_multi_turn:raising_rollout", "raised on group 0 sample 0: KeyError"),
        ("tests.trainer.test_multi_turn:not_a_sample", "returned a dict on group 0 sample 0"),
        ("tests.trainer.test_multi_turn:another_sample", "returned another Sample on group 0 sample 0; it must fill"),
    ],
)
def test_a_broken_plugin_stops_the_run_naming_it_and_the_sample(fn, match):
    with pytest.raises(RolloutPluginError, match=match):
        _run(fn, _jobs(1))


def test_sample_checks_hold_every_per_token_field_to_the_output():
    with pytest.raises(ValueError, match="2 output tokens, but 1 loss_mask"):
        Sample("", prompt_ids=[1], output_ids=[3, 4], loss_mask=[True], logprobs=[0.0, 0.0]).check(32)
    with pytest.raises(ValueError, match="output_ids holds 99"):
        Sample("", prompt_ids=[1], output_ids=[99], loss_mask=[True], logprobs=[-1.0]).check(32)
    with pytest.raises(ValueError, match=r"1 output tokens, but 0 token_fields\['routed_experts'\]"):
        Sample(
            "", prompt_ids=[1], output_ids=[3], loss_mask=[True], logprobs=[-1.0], token_fields={"routed_experts": []}
        ).check(32)


def test_per_token_fields_ride_along_each_turn_and_pad_around_environment_tokens():
    s = Sample("q", prompt_ids=[1])
    t = turn([1], [5, 6], [-0.1, -0.2], "stop")
    t.token_fields["version"] = [3, 3]
    s.add_policy(t)
    s.add_environment([9])
    s.add_policy(turn([1, 5, 6, 9], [7], [-0.3], "length"))
    assert s.output_ids == [5, 6, 9, 7] and s.loss_mask == [True, True, False, True]
    assert s.logprobs == [-0.1, -0.2, 0.0, -0.3] and s.finish_reason == "length"
    assert s.token_fields == {"version": [3, 3, None, None]}
    s.check(32)


@pytest.mark.parametrize(
    "ref, match",
    [
        ("tests.trainer.test_multi_turn:one_argument", "must accept two positional arguments"),
        ("tests.trainer.test_multi_turn:nope", "rollout function .* has no attribute 'nope'"),
        ("no_such_module_xyz:fn", "rollout function .* module 'no_such_module_xyz' not found"),
    ],
)
def test_load_rollout_fn_errors_name_the_reference(ref, match):
    with pytest.raises(ValueError, match=match):
        load_rollout_fn(ref)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.fn=calculator_tool"], "rollout.fn must be 'module.path:function'"),
        (["rollout.client=http"], "rollout.client only applies with rollout.fn"),
        (["rollout.fn=m:f", "rollout.client=grpc"], "rollout.client must be one of"),
    ],
)
def test_bad_rollout_config_is_one_error_naming_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve(composed(*overrides))


# ------------------------------------------------------------------ end to end
def cli(run_dir, *overrides):
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": os.pathsep.join([str(REPO / "examples"), str(REPO)])}
    cmd = [sys.executable, "-m", "miles_k3.cli.train", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_calculator_tool_trains_end_to_end_with_both_clients(tmp_path):
    rows = cli(tmp_path / "engine", "rollout.fn=calculator_tool:rollout")
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert any(r["groups_kept"] > 0 for r in steps)
    for r in steps:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["samples_all_masked"] == 0
        assert r["response_env_tokens_mean"] > 0  # the policy called the tool, its result was masked in
        if r["groups_kept"]:
            # per-turn engine log-probs against the trainer's recomputation over the whole sequence
            assert r["train_rollout_logprob_abs_diff"] < 1e-5
            assert r["grad_norm"] > 0
            # k3_grpo replays the routing: each turn's table (the context's and the turn's tokens) reached the
            # trainer, the tool's tokens included (fed as the next turn's prompt); fp32 routers agree
            assert r["routing_agreement"] > 0.999
    assert 0.0 <= rows[-1]["eval_accuracy"] <= 1.0
    # through miles-serve's /generate on loopback: the same samples (seeded per sample and turn) and rewards; the
    # log-probs agree to float noise (the engine batched the turns in another order)
    http = cli(tmp_path / "http", "rollout.fn=calculator_tool:rollout", "rollout.client=http")
    assert len(http) == len(rows)
    for h, r in zip(http, rows):
        assert h.keys() == r.keys()
        gaps = {k for k in r if k.startswith("train_rollout_")}  # float noise itself: bounded, not compared
        assert all(h[k] < 1e-5 for k in gaps if "logprob_abs_diff" in k)
        for k in r.keys() - TIMING - gaps:
            exact = k.startswith(("reward", "groups", "samples", "response", "eval", "step", "rollout_r", "rollout_g"))
            assert h[k] == (r[k] if exact else pytest.approx(r[k], rel=1e-4, abs=1e-6)), k


def test_all_masked_responses_are_dropped_and_counted(tmp_path):
    rows = cli(
        tmp_path / "run",
        "rollout.fn=tests.trainer.test_multi_turn:all_masked_rollout",
        "trainer.max_steps=1",
        "trainer.eval_before=false",
        "algo.dynamic_sampling=false",
        "data.eval_path=null",
    )
    (step,) = rows
    assert step["samples_all_masked"] == 8  # half of 4 x 4; the rest trained
    assert step["groups_sampled"] == 4
