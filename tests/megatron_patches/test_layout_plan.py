"""The layout planner's per-rank bytes equal the real shards of k3-tiny (TP=2, PP=2, EP=2 in one gloo world)."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_patches.layout_plan import Layout, LayoutPlanner, param_bytes
from miles_k3.model.config import K3Config
from miles_k3.model.lora_spec import LoraSpec

LAYOUTS = (Layout(tp=2), Layout(pp=2, dp=1), Layout(ep=2, dp=2))
LORA = LoraSpec(rank=8)


def _worker(rank: int, port: int, out_dir: str) -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the test instead of stalling CI
    from megatron_patches.lora import lora_parameters
    from megatron_patches.model import build_policy
    from megatron_patches.parallel import destroy_parallel, init_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = K3Config.from_preset("k3-tiny")
    results = []
    for layout in LAYOUTS:
        init_parallel(layout.tp, layout.pp, layout.cp, layout.ep)
        model = build_policy(config, None, LORA, dtype=torch.bfloat16)
        counts = param_bytes(model)
        params = lora_parameters(model)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, eps=1e-8)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        counts["optimizer"] = sum(
            t.numel() * t.element_size() for p in params for t in opt.state[p].values() if t.shape == p.shape
        )
        counts["lora_grads"] = sum(p.grad.numel() * p.grad.element_size() for p in params)
        results.append(counts)
        destroy_parallel()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from megatron_patches.parallel import free_port

    out = tmp_path_factory.mktemp("layout_plan")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.fixture
def no_world():
    """The planner builds ranks in fake worlds of its own: lend it this process without the package's world
    of one (conftest), and put an equal one back afterwards."""
    from megatron_patches.parallel import destroy_parallel, init_parallel, start_single_process_world

    destroy_parallel()
    dist.destroy_process_group()
    yield
    start_single_process_world()
    init_parallel(1)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[str(lay) for lay in LAYOUTS])
def test_planner_bytes_equal_the_real_shards(shards, index, no_world):
    layout = LAYOUTS[index]
    stages = LayoutPlanner(K3Config.from_preset("k3-tiny"), LORA).stages(layout, None)
    for rank in range(2):
        real, planned = shards[rank][index], stages[rank // (layout.world // layout.pp)]
        got = {
            "base_experts": planned.base_experts,
            "base_other": planned.base_other,
            "lora": planned.lora,
            "lora_grads": planned.lora_grads,
            "optimizer": planned.optimizer,
        }
        assert got == real, (rank, got, real)
        assert real["base_experts"] > 0 and real["lora"] > 0


def test_activations_grow_with_tokens_and_shrink_with_cp(no_world):
    planner = LayoutPlanner(K3Config.from_preset("k3-tiny"), LORA)
    short, long = (planner.stages(Layout(), t)[0].activations for t in (256, 1024))
    assert 0 < short < long
    assert planner.stages(Layout(cp=2), 1024)[0].activations == planner.stages(Layout(), 512)[0].activations
