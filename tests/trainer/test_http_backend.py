"""`rollout.backend=http`: the RL loop with its engines behind HTTP (`miles_k3.trainer.http_engines`), here two
real `miles-serve` processes on 127.0.0.1: the same samples and update as the colocated engine (per-sample
seeds go out as `sampling_seed`), the adapter sent as a new version each step, the routing returned for replay;
a server killed mid-run leaves the set and the run finishes with every step once."""

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from rollout.server.launch import local_servers
from tests.trainer.test_cli_run import cli, rows

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["logging.wandb=disabled", "trainer.eval_before=false", "trainer.deterministic=true"]


def servers(n: int, max_loras: int = 2):
    """`n` miles-serve processes shaped like k3_grpo's engine (the embedded base, float32, a rank-8 pool of
    `max_loras` slots: the next adapter version loads before the oldest kept one unloads, routing recorded)."""
    flags = ["--model", "builtin:k3-tiny-arith", "--quantize", "none", "--max-lora-rank", "8"]
    flags += ["--max-loras", str(max_loras), "--record-routing", "--log-level", "warning"]
    return local_servers(n, flags, cwd=str(REPO))


def urls_override(urls: list[str]) -> str:
    return "rollout.urls=[" + ",".join(json.dumps(u) for u in urls) + "]"


def test_two_servers_draw_the_colocated_engines_samples_and_train_the_same_update(tmp_path):
    one = cli(tmp_path / "one", "trainer.max_steps=2", *FLAGS)
    assert one.returncode == 0, one.stderr[-3000:]
    with servers(2) as (_, urls):
        out = cli(tmp_path / "http", "trainer.max_steps=2", *FLAGS, "rollout.backend=http", urls_override(urls))
    assert out.returncode == 0, out.stderr[-3000:]
    colocated = [r for r in rows(tmp_path / "one") if "loss" in r]
    http = [r for r in rows(tmp_path / "http") if "loss" in r]
    assert [r["step"] for r in http] == [1, 2]
    for a, b in zip(http, colocated):
        assert a["reward_mean"] == b["reward_mean"]  # step 2 samples with the adapter sent over HTTP
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["train_rollout_logprob_abs_diff"] < 1e-5  # the servers' log-probs are the trainer's
        assert a["routing_agreement"] == 1.0  # and their recorded experts replayed
        assert a["adapter_sync_sent_bytes_max"] > 0 and a["rollout_servers_lost"] == 0


def test_a_server_killed_mid_run_leaves_the_set_and_every_step_is_logged_once(tmp_path):
    run = tmp_path / "run"
    with servers(2) as (procs, urls):

        def kill_after_step_one() -> None:
            deadline = time.time() + 300
            while time.time() < deadline:
                metrics = run / "metrics.jsonl"
                if metrics.is_file() and any('"step": 1' in x for x in metrics.read_text().splitlines()):
                    procs[1].send_signal(signal.SIGKILL)
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_after_step_one, daemon=True)
        killer.start()
        out = cli(run, "trainer.max_steps=4", *FLAGS, "rollout.backend=http", urls_override(urls))
        killer.join()
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in rows(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert sum(r["rollout_servers_lost"] for r in steps) == 1
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)


def test_generation_one_version_ahead_trains_no_token_older_than_one_update(tmp_path):
    """rollout.max_staleness=1: step j's rollouts are generated while step j - 1 trains, with the adapter of
    update j - 2; every sample is tagged with the adapter that drew it, none is trained more than one update
    old, and the servers keep the last two versions loaded."""
    with servers(2, max_loras=3) as (_, urls):
        out = cli(
            tmp_path / "ahead",
            "trainer.max_steps=4",
            *FLAGS,
            "rollout.backend=http",
            urls_override(urls),
            "rollout.max_staleness=1",
        )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in rows(tmp_path / "ahead") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["policy_staleness_max"] == 0  # the first step's rollouts use the first adapter
    assert all(r["policy_staleness_max"] <= 1 and r["samples_stale_dropped"] == 0 for r in steps)
    assert max(r["policy_staleness_max"] for r in steps[1:]) == 1  # generation did run ahead
    # off-policy by one update: the servers' log-probs are the older adapter's, so the gap to the trainer's grows
    assert max(r["train_rollout_logprob_abs_diff"] for r in steps[1:]) > 1e-4


@pytest.mark.parametrize("partial", ["continue", "restart"])
def test_an_update_stops_the_rollouts_in_flight_and_the_new_version_draws_the_rest(tmp_path, partial):
    """rollout.partial: generation runs ahead (staleness 1) over long answers, so every update meets requests in
    flight; they are aborted and sent again under the new adapter: from their tokens (continue: each token
    tagged with the version that drew it, a sample's age its oldest token's) or from scratch (restart)."""
    with servers(2, max_loras=3) as (_, urls):
        out = cli(
            tmp_path / partial,
            "trainer.max_steps=3",
            "rollout.stop_at_eos=false",  # long answers: generation outlasts the update
            "rollout.max_new_tokens=48",
            *FLAGS,
            "rollout.backend=http",
            urls_override(urls),
            "rollout.max_staleness=1",
            f"rollout.partial={partial}",
        )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in rows(tmp_path / partial) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["policy_staleness_max"] <= 1 and r["samples_stale_dropped"] == 0 for r in steps)
    assert sum(r["rollout_partial_resent"] for r in steps) > 0  # updates did stop rollouts in flight


def test_partial_rollouts_need_rollouts_ahead():
    from miles_k3.trainer.config import compose_recipe
    from miles_k3.trainer.resolve import resolve

    with pytest.raises(ValueError, match=r"^rollout\.partial applies with rollout\.max_staleness > 0"):
        resolve(compose_recipe("rollout.backend=http", "rollout.urls=[http://127.0.0.1:1]", "rollout.partial=continue"))
