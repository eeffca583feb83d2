"""reduce_lora_grads_ over a DP=2 world (two processes, gloo): without it each rank's adapter gradients
are its own rows' only (megatron does not reduce parameters outside its DDP wrapper), with it they are
the union batch's; replicas are checked identical; a factor with no gradient on some ranks is summed."""

import pytest
import torch

from tests.megatron_patches import ep_worker
from tests.megatron_patches.common import spawn_world

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_world(ep_worker.worker, WORLD, tmp_path_factory.mktemp("dp2"), "reduction")


@pytest.fixture(scope="module")
def single():
    return ep_worker.run_case(ep_worker.configs()["k3-tiny"], False)


def _close(a, b, tol=1e-10):
    return float((a - b).norm()) <= tol * max(float(b.norm()), 1e-12)


def test_without_the_reduction_gradients_miss_the_other_ranks_tokens(ranks, single):
    for rank in range(WORLD):
        got = ranks[rank]["unreduced"]["grads"]
        wrong = [k for k, w in single["grads"].items() if not _close(got[k], w, 1e-6)]
        # every adapter sees both rows' tokens in the reference: dense and expert factors alike are off
        assert any(".experts." in k for k in wrong) and any(".experts." not in k for k in wrong), wrong[:4]
    summed = {k: ranks[0]["unreduced"]["grads"][k] + ranks[1]["unreduced"]["grads"][k] for k in single["grads"]}
    assert all(_close(summed[k], w) for k, w in single["grads"].items())


def test_replicas_start_identical_and_a_divergence_is_named(ranks):
    for r in ranks:
        msg = r["replicas"]["perturbed"]
        assert msg is not None and "experts.w1.lora_A" in msg and "expert data parallel" in msg


def test_a_gradient_missing_on_one_rank_is_summed_and_none_everywhere_stays_none(ranks):
    for r in ranks:
        rep = r["replicas"]
        assert torch.equal(rep["one_rank"], torch.ones_like(rep["one_rank"]))
        assert torch.equal(rep["both"], torch.full_like(rep["both"], 5.0))
        assert rep["none_anywhere"]
