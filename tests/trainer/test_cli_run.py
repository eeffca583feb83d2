"""`miles-train` end to end through the real CLI (Hydra, megatron policy, engine, rewards, checkpoints, wandb
offline): a shortened embedded run, SIGKILL mid-run + resume reproducing the uninterrupted metrics, the Ray
launcher, local TP=2. Malformed inputs: tests/cli/test_malformed_inputs.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = [
    "recipe=k3_grpo",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "trainer.max_steps=3",
    "trainer.save_every=1",
    "trainer.eval_every=0",
    "data.eval_max_prompts=16",
    "logging.progress=false",
    "cluster.threads_per_worker=1",
]
TIMING = {"rollout_s", "train_s", "step_s", "samples_per_s", "adapter_sync_ms"}


def cli(run_dir, *overrides, wait=True, timeout=600):
    cmd = [sys.executable, "-m", "miles_k3.cli.train", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_SILENT": "true"}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return out


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def stable(rs):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]


def test_short_embedded_run(tmp_path):
    # pools kept between steps: every step's rollout must still see the updated adapter, never a prefix
    # cached under the previous one (the log-prob agreement below would catch it)
    out = cli(tmp_path / "run", "logging.wandb=offline", "rollout.release_memory=false")
    assert out.returncode == 0, out.stderr[-3000:]
    rs = rows(tmp_path / "run")
    assert [r["step"] for r in rs] == [0, 1, 2, 3, 3]
    assert 0.0 <= rs[0]["eval_accuracy"] <= 1.0 and rs[0]["eval_samples"] == 16
    for r in rs[1:4]:
        assert 0.0 <= r["reward_mean"] <= 1.0
        # BF16-base mode in fp32 on CPU: the engine and the trainer are the same model
        assert r["train_rollout_logprob_abs_diff"] < 1e-4
        assert r["adapter_sync_ms"] > 0 and r["groups_kept"] <= 4
        assert r["rollout_graph_captures"] == r["rollout_graph_replays"] == 0  # no CUDA graphs on CPU
        assert r["rollout_retractions"] >= 0
    assert "eval_accuracy" in rs[4]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000003"]  # keep_checkpoints=2
    adapter = tmp_path / "run" / "checkpoints" / "step_00000003" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_sigkill_mid_run_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    flags = ["trainer.max_steps=4", "trainer.deterministic=true", "logging.wandb=disabled"]
    ref = cli(tmp_path / "ref", *flags)
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = tmp_path / "killed"
    proc = cli(run, *flags, wait=False)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_00000002").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = cli(run, *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert stable(rows(run)) == stable(rows(tmp_path / "ref"))


def test_damaged_checkpoint_is_skipped_on_resume(tmp_path):
    run = tmp_path / "run"
    first = cli(run, "trainer.max_steps=2", "logging.wandb=disabled")
    assert first.returncode == 0, first.stderr[-3000:]
    state = run / "checkpoints" / "step_00000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    again = cli(run, "trainer.max_steps=3", "logging.wandb=disabled")
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    assert "skipping damaged checkpoint" in log and "(step 1)" in log
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3, 3]
    assert list((run / "checkpoints").glob("step_00000002.damaged-*"))  # kept for a person to inspect


def test_ray_launcher_runs_the_colocated_loop(tmp_path):
    """Two rank actors, each a trainer rank of TP=2 and a shard of one engine replica of TP=2: the engine
    computes the trainer's log-probs at both steps (the second after a shard-to-shard sync)."""
    out = cli(
        tmp_path / "run",
        "cluster=ray_cpu",
        "cluster.num_workers=2",
        "parallel=tp2",
        "rollout.tp=2",
        "trainer.max_steps=2",
        "logging.wandb=disabled",
        "trainer.eval_before=false",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rs = rows(tmp_path / "run")
    assert [r["step"] for r in rs] == [1, 2, 2]
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in rs if "loss" in r)


def test_local_parallel_layouts_match_single_rank(tmp_path):
    """TP=2, TP=2 with SP, DP=2, PP=2 (several micro-batches), EP=2 (inside DP=2), CP=2 and TP=2 x PP=2 through the
    CLI: the first step's rewards, loss and gradient norm are the single rank's."""
    flags = ["trainer.max_steps=2", "logging.wandb=disabled", "trainer.eval_before=false", "trainer.deterministic=true"]
    one = cli(tmp_path / "tp1", *flags)
    two = cli(tmp_path / "tp2", *flags, "parallel=tp2", "cluster.num_workers=2")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    r1, r2 = rows(tmp_path / "tp1"), rows(tmp_path / "tp2")
    # step 1 samples the untrained adapter: identical; the update itself agrees to fp32 reduction order
    assert r1[0]["reward_mean"] == r2[0]["reward_mean"]
    assert r2[0]["loss"] == pytest.approx(r1[0]["loss"], abs=1e-5)
    assert r2[0]["grad_norm"] == pytest.approx(r1[0]["grad_norm"], rel=1e-4)
    # sequence parallel over the same two ranks: the same update (the packed batch is padded to even length)
    sp = cli(tmp_path / "sp", *flags, "parallel=tp2", "parallel.sp=true", "cluster.num_workers=2")
    assert sp.returncode == 0, sp.stderr[-3000:]
    r3 = rows(tmp_path / "sp")
    assert r3[0]["reward_mean"] == r1[0]["reward_mean"]
    assert r3[0]["loss"] == pytest.approx(r1[0]["loss"], abs=1e-5)
    assert r3[0]["grad_norm"] == pytest.approx(r1[0]["grad_norm"], rel=1e-4)
    # data parallel: each rank half the groups, gradients summed, metrics of the whole batch
    dp = cli(tmp_path / "dp", *flags, "parallel=dp2", "cluster.num_workers=2")
    assert dp.returncode == 0, dp.stderr[-3000:]
    r4 = rows(tmp_path / "dp")
    assert r4[0]["reward_mean"] == r1[0]["reward_mean"]
    assert r4[0]["loss"] == pytest.approx(r1[0]["loss"], abs=1e-5)
    assert r4[0]["grad_norm"] == pytest.approx(r1[0]["grad_norm"], rel=1e-4)
    assert r4[0]["entropy"] == pytest.approx(r1[0]["entropy"], rel=1e-4)
    for name, layout in (
        ("pp2", ["parallel=pp2", "parallel.micro_batch_tokens=64", "cluster.num_workers=2"]),
        ("ep2", ["parallel=ep2", "cluster.num_workers=2"]),
        ("cp2", ["parallel=cp2", "cluster.num_workers=2"]),
        ("tp2_pp2", ["parallel=tp2_pp2", "parallel.micro_batch_tokens=64", "cluster.num_workers=4"]),
    ):
        out = cli(tmp_path / name, *flags, *layout, timeout=900)
        assert out.returncode == 0, (name, out.stderr[-3000:])
        got = rows(tmp_path / name)
        assert got[0]["reward_mean"] == r1[0]["reward_mean"], name
        assert got[0]["loss"] == pytest.approx(r1[0]["loss"], abs=1e-5), name
        assert got[0]["grad_norm"] == pytest.approx(r1[0]["grad_norm"], rel=1e-4), name
        # step 2 samples with the adapter gathered over the layout's shards and synced into the engine: the
        # engine's log-probs are the trainer's again
        assert got[1]["train_rollout_logprob_abs_diff"] < 1e-4, name
    # resuming a TP=2 run: rank 0 reads the checkpoint and hands each rank its own optimizer / RNG state
    more = cli(
        tmp_path / "tp2",
        "trainer.max_steps=3",
        "logging.wandb=disabled",
        "trainer.eval_before=false",
        "parallel=tp2",
        "cluster.num_workers=2",
        "trainer.resume=auto",
    )
    assert more.returncode == 0, more.stderr[-3000:]
    # metrics.jsonl is appended to: a run that started over instead of resuming would repeat steps 1-2
    assert [r["step"] for r in rows(tmp_path / "tp2") if "loss" in r] == [1, 2, 3]


def test_engine_layouts_in_the_loop_match_single_rank(tmp_path):
    """The engine's own layout inside the loop (rollout.tp / dcp / ep: one shard of a replica on every trainer
    rank, the adapter synced shard to shard): the same samples as one process (rewards equal at both steps:
    the second samples with the synced adapter), the same update, and the engine's log-probs the trainer's."""
    flags = ["trainer.max_steps=2", "logging.wandb=disabled", "trainer.eval_before=false", "trainer.deterministic=true"]
    one = cli(tmp_path / "one", *flags)
    assert one.returncode == 0, one.stderr[-3000:]
    r1 = [r for r in rows(tmp_path / "one") if "loss" in r]
    for name, layout in (
        ("tp2_etp2", ["parallel=tp2", "rollout.tp=2", "cluster.num_workers=2"]),
        ("tp2_etp1", ["parallel=tp2", "cluster.num_workers=2"]),  # two engine replicas of one rank
        (
            "pp2_etp2_dcp2",
            [
                "parallel=pp2",
                "parallel.micro_batch_tokens=64",
                "rollout.tp=2",
                "rollout.dcp=2",
                "cluster.num_workers=2",
            ],
        ),
        ("ep2_etp2_ep", ["parallel=ep2", "rollout.tp=2", "rollout.ep=true", "cluster.num_workers=2"]),
        ("tp2dp2_etp2", ["parallel.tp=2", "parallel.dp=2", "rollout.tp=2", "cluster.num_workers=4"]),
    ):
        out = cli(tmp_path / name, *flags, *layout, timeout=900)
        assert out.returncode == 0, (name, out.stderr[-3000:])
        got = [r for r in rows(tmp_path / name) if "loss" in r]
        for a, b in zip(got, r1):
            assert a["reward_mean"] == b["reward_mean"], name
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), name
            assert a["train_rollout_logprob_abs_diff"] < 1e-5, name
            # the sharded engine records every token's experts (routers replicated on its ranks) and the trainer
            # replays them: k3_grpo's default
            assert a["routing_agreement"] == 1.0, name
        # trainer and engine blocks that coincide (TP against TP, EP against EP) move nothing
        moved = got[0]["adapter_sync_received_bytes_max"]
        assert (moved == 0) == (name in ("tp2_etp2", "ep2_etp2_ep", "tp2dp2_etp2")), (name, moved)


def test_the_k3_gb300x64_shape_runs_on_four_cpu_ranks(tmp_path):
    """recipe=k3_gb300x64's shape scaled to the embedded model: the trainer in pipeline x context parallel with
    expert parallelism inside the CP group, activation recompute, and one engine replica over all ranks with
    whole experts per rank; two steps, the engine's log-probs the trainer's after the shard-to-shard sync."""
    out = cli(
        tmp_path / "twin",
        "trainer.max_steps=2",
        "logging.wandb=disabled",
        "trainer.eval_before=false",
        "parallel.pp=2",
        "parallel.cp=2",
        "parallel.ep=2",
        "parallel.recompute=true",
        "parallel.micro_batch_tokens=64",
        "rollout.tp=4",
        "rollout.ep=true",
        "cluster.num_workers=4",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = [r for r in rows(tmp_path / "twin") if "loss" in r]
    assert [r["step"] for r in got] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in got)
    assert got[0]["adapter_sync_received_bytes_max"] > 0  # pipeline stages hold other layers than a TP shard needs
