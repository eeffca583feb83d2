"""EP=2 (two ranks, gloo; data parallel with expert parallelism inside it) and DP=2 compute what one process
computes on the union of the ranks' tokens: loss, every LoRA gradient, the clipped gradients, the global
norm and the exported adapter; each EP rank holds and loads only its own experts."""

import pytest
import torch

from megatron_patches.expert_parallel import ExpertParallel, expert_share
from tests.megatron_patches import ep_worker
from tests.megatron_patches.common import spawn_world

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_world(ep_worker.worker, WORLD, tmp_path_factory.mktemp("ep2"), "ep")


@pytest.fixture(scope="module")
def single():
    return {name: ep_worker.run_case(c, skew) for name, (c, skew) in ep_worker.cases().items()}


def _close(a, b, tol=1e-10):
    return float((a - b).norm()) <= tol * max(float(b.norm()), 1e-12)


def _layout(case: str) -> tuple[str, str]:
    kind, name = case.split("/", 1)
    return kind, name


CASES = [f"ep/{n}" for n in ep_worker.cases()] + [f"dp/{n}" for n in ep_worker.configs()]


@pytest.mark.parametrize("case", CASES)
def test_equals_single_process_on_the_union_batch(ranks, single, case):
    kind, name = _layout(case)
    want = single[name]
    got = [r[case] for r in ranks]
    assert _close(sum(g["loss"] for g in got), want["loss"])
    for rank, g in enumerate(got):
        assert g["grads"].keys() == want["grads"].keys()
        for key, w in want["grads"].items():
            assert w is not None and g["grads"][key] is not None, key
            assert _close(g["grads"][key], w), (rank, key)
            assert _close(g["clipped"][key], want["clipped"][key]), (rank, key)
        assert _close(g["norm"], want["norm"])
        # export: every expert, stacked in global order, on every rank
        assert all(torch.equal(g["export"][k], want["export"][k]) for k in want["export"])
        experts = ep_worker.configs()[name.split("/")[0]].num_experts
        share = experts // WORLD
        assert g["held"] == (list(range(rank * share, (rank + 1) * share)) if kind == "ep" else list(range(experts)))


def test_skewed_routing_leaves_one_rank_without_rows(single):
    """The skewed cases really send every token copy to rank 0's experts (so rank 1 ran its experts on no
    rows, yet took part in every exchange, forward and backward)."""
    for name in ep_worker.cases():
        experts = ep_worker.configs()[name.split("/")[0]].num_experts
        assert (single[name]["max_routed"] < experts // WORLD) == name.endswith("/skewed"), name


@pytest.mark.parametrize("case", CASES)
def test_ranks_differ_before_the_reduction(ranks, single, case):
    """Megatron does not reduce adapter gradients: before `reduce_lora_grads_` each rank's dense adapter
    gradients cover only its own row, and only their sum is the single process's."""
    _, name = _layout(case)
    want = single[name]["grads"]
    dense = [k for k in want if ".experts." not in k]
    assert any(not _close(ranks[0][case]["before"][k], want[k], 1e-6) for k in dense)
    for k in dense:
        assert _close(ranks[0][case]["before"][k] + ranks[1][case]["before"][k], want[k])


def test_expert_count_must_divide():
    with pytest.raises(ValueError, match=r"K3Config\.num_experts=16 is not divisible by the expert-parallel size 3"):
        ExpertParallel(3, 0).split(16)


def test_expert_parallel_refuses_tensor_parallel(monkeypatch):
    from megatron_patches import expert_parallel

    monkeypatch.setattr(expert_parallel.ps, "get_expert_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(expert_parallel.ps, "get_expert_tensor_parallel_world_size", lambda: 1)
    with pytest.raises(ValueError, match=r"parallel\.ep=2 with parallel\.tp=2"):
        expert_share(2)
