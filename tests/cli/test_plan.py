"""`miles-k3 plan`: bad arguments are one line naming the flag (exit 2); a k3-tiny plan prints a verdict."""

from __future__ import annotations

import pytest

from miles_k3.cli.main import main


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--gpus", "0", "--gpu-memory-gb", "80"], "--gpus"),
        (["--gpus", "2", "--gpu-memory-gb", "-1"], "--gpu-memory-gb"),
        (["--gpus", "2", "--gpu-memory-gb", "80", "--layout", "tp=3"], "--layout"),
        (["--gpus", "2", "--gpu-memory-gb", "80", "--layout", "tp=2,pp=x"], "--layout"),
        (
            ["--gpus", "2", "--gpu-memory-gb", "80", "--seq-len", "64", "--micro-batch-tokens", "32"],
            "--micro-batch-tokens",
        ),
        (["--gpus", "2", "--gpu-memory-gb", "80", "--engine-memory-gb", "1", "--engine-seqs", "2"], "--engine-seqs"),
    ],
)
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    assert main(["plan", "--preset", "k3-tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_tiny_plan_prints_a_fitting_layout(capsys):
    assert (
        main(
            [
                "plan",
                "--preset",
                "k3-tiny",
                "--gpus",
                "2",
                "--gpu-memory-gb",
                "80",
                "--seq-len",
                "256",
                "--layout",
                "tp=2",
                "--layout",
                "pp=2",
                "--engine-seqs",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tp=2,pp=1,cp=1,ep=1,dp=1: peak rank" in out and "FITS" in out
    assert "best fitting layout:" in out


def test_plan_counts_activations_with_and_without_recompute(capsys):
    """Between the two peaks the layout fits only with recompute, and the plan says so (and which layout)."""
    argv = ["plan", "--preset", "k3-tiny", "--gpus", "2", "--seq-len", "1024", "--layout", "tp=2", "--engine-seqs", "1"]
    assert main([*argv, "--gpu-memory-gb", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "FITS with recompute" in out and "best fitting layout with recompute (parallel.recompute=true)" in out
    assert main([*argv, "--gpu-memory-gb", "0.05"]) == 1
    assert "no candidate layout fits, even with recompute" in capsys.readouterr().out


def test_recompute_keeps_the_layers_inputs_and_rebuilds_one_layer(no_world):
    """Per micro-batch in flight recompute keeps the layers' inputs plus what lies outside the layers; one
    layer's activations come back during its backward. Without it every layer's saved tensors are held."""
    from megatron_patches.layout_plan import Layout, LayoutPlanner
    from miles_k3.model import K3Config
    from miles_k3.model.lora_spec import LoraSpec

    planner = LayoutPlanner(K3Config.from_preset("k3-tiny"), LoraSpec(rank=8))
    (plain,) = planner.stages(Layout(), 2048, recompute=False)
    (rc,) = planner.stages(Layout(), 2048, recompute=True)
    assert plain.recompute_peak == 0 and 0 < rc.recompute_peak < plain.activations
    assert rc.activations < plain.activations / 3
    assert rc.trainer_total < plain.trainer_total
    ((a, b),) = planner._probes.values()  # the probe counts per layer and the layers' inputs
    assert len(a.layers) == 6 and all(x > 0 for x in a.layers) and a.inputs > 0
    assert a.held(False) == sum(a.layers) + a.other and a.peak(True) == max(a.layers)


@pytest.fixture
def no_world():
    """The planner builds ranks in fake worlds of its own: lend it this process without the package's world."""
    import torch.distributed as dist

    from megatron_patches.parallel import destroy_parallel, init_parallel, start_single_process_world

    if not dist.is_initialized():
        yield
        return
    destroy_parallel()
    dist.destroy_process_group()
    yield
    start_single_process_world()
    init_parallel(1)


# ---------------------------------------------------------------------------------------------- the loop plan
# (both phases per GPU: `miles_k3.trainer.loop_plan`, the engine shard's bytes from `rollout.shard_plan`)

PLAN = ["plan", "--preset", "k3-tiny", "--gpus", "2"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--engine-layout", "tp=2,dcp=3"], "--engine-layout"),  # dcp must divide tp
        (["--engine-layout", "tp=2,ep=maybe"], "--engine-layout"),
        (["--engine-layout", "ep=1"], "--engine-layout"),  # no tp
        (["--engine-layout", "tp=1,ep=1"], "--engine-layout"),  # EP needs tp > 1
        (["--engine-layout", "tp=4"], "--engine-layout"),  # does not divide --gpus 2
        (["--engine-layout", "tp=2,pp=2"], "--engine-layout"),
        (["--offload", "optimizer+gpu"], "--offload"),
        (["--quantize", "fp8"], "--quantize"),
        (["--graphs-gb", "-1"], "--graphs-gb"),
    ],
)
def test_bad_loop_arguments_name_the_flag(argv, flag, capsys):
    assert main([*PLAN, "--gpu-memory-gb", "80", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_an_engine_layout_the_model_cannot_split_names_the_flag_and_the_field(capsys):
    """k3-tiny has 4 heads: an engine of 8 ranks cannot split them (on 8 GPUs, so --gpus allows it)."""
    assert main(["plan", "--preset", "k3-tiny", "--gpus", "8", "--gpu-memory-gb", "80", "--engine-layout", "tp=8"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "--engine-layout 'tp=8'" in err and "kda_num_heads" in err, err


def _tensor_bytes(model, pool) -> tuple[int, int, int]:
    """(all weights, routed experts, adapter pool) of a built engine, counted without rollout.shard_plan."""
    from rollout.linears import EngineExperts

    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    experts = sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, EngineExperts)
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    )
    adapters = sum(t.numel() * t.element_size() for d in (pool.A, pool.B) for t in d.values())
    return weights, experts, adapters


@pytest.mark.parametrize(
    "ep, dcp, quantize",
    [(False, 1, "experts"), (True, 1, "experts"), (False, 2, "all"), (True, 2, "none")],
)
def test_engine_shard_bytes_equal_a_real_shard(ep, dcp, quantize, no_world):
    """The meta count of one shard equals the tensors of a real TP=2 shard built on CPU by `build_engine_model`
    (rank 0 and rank 1 of a fake two-rank world: the engine's own EngineTP, real reads of the base's slices)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from miles_k3.model import K3Config
    from miles_k3.model.lora_spec import LoraSpec
    from miles_k3.model.modeling import reference_state
    from rollout.model_runner import build_engine_model
    from rollout.parallel import EngineTP
    from rollout.shard_plan import EngineLayout, engine_shard_bytes

    config, lora = K3Config.from_preset("k3-tiny"), LoraSpec(rank=4)
    planned = engine_shard_bytes(config, EngineLayout(2, dcp, ep), quantize=quantize, lora=lora)
    state = reference_state(config)
    for rank in (0, 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            tp = EngineTP(ep_size=2 if ep else 1, dcp_size=dcp, control=dist.group.WORLD)
            model, pool = build_engine_model(
                config, state, quantize=quantize, lora=lora, max_adapters=1, dtype=torch.bfloat16, tp=tp
            )
        finally:
            dist.destroy_process_group()
        assert _tensor_bytes(model, pool) == (planned.weights, planned.routed_experts, planned.adapters)
    whole = engine_shard_bytes(config, EngineLayout(1), quantize=quantize, lora=lora)
    assert planned.routed_experts * 2 == whole.routed_experts  # half the experts' bytes, split either way


def test_mxfp4_experts_take_4_25_bits_an_element(no_world):
    from miles_k3.model import K3Config
    from rollout.shard_plan import EngineLayout, engine_shard_bytes

    config = K3Config.from_preset("k3-tiny")
    for layout in (EngineLayout(1), EngineLayout(2, 1, True), EngineLayout(2)):
        packed = engine_shard_bytes(config, layout, quantize="experts").routed_experts
        bf16 = engine_shard_bytes(config, layout, quantize="none").routed_experts
        assert packed * 8 / (bf16 / 2) == 4.25


def test_each_offload_lowers_its_phase_by_exactly_its_bytes(no_world):
    """Optimizer / base offload take their bytes off the rollout phase, the engine's weights off training; the
    other phase does not move, and `moved` is the sum of what is offloaded."""
    from megatron_patches.layout_plan import Layout, LayoutPlanner
    from miles_k3.model import K3Config
    from miles_k3.model.lora_spec import LoraSpec
    from miles_k3.trainer.loop_plan import EngineOnGPU, Offloads, best, loop_plan
    from rollout.shard_plan import EngineLayout, engine_shard_bytes

    config, lora = K3Config.from_preset("k3-tiny"), LoraSpec(rank=8)
    (stage,) = stages = LayoutPlanner(config, lora).stages(Layout(), 512)
    shard = engine_shard_bytes(config, EngineLayout(2, 1, True), lora=lora)
    engine = EngineOnGPU(EngineLayout(2, 1, True), shard, pools=3 << 20, graphs=5 << 20)
    plans = {str(o): loop_plan(Layout(), stages, engine, o, False) for o in Offloads.every()}
    none = plans["none"]
    assert none.rollout.total == stage.base + stage.lora + stage.optimizer + shard.total + (8 << 20)
    assert none.training.total == stage.trainer_total + shard.total and none.moved == 0
    assert stage.optimizer > 0 and shard.weights > 0
    for name, phase, other, freed in (
        ("optimizer", "rollout", "training", stage.optimizer),
        ("base", "rollout", "training", stage.base),
        ("engine", "training", "rollout", shard.weights),
    ):
        p = plans[name]
        assert getattr(none, phase).total - getattr(p, phase).total == freed, name
        assert getattr(p, other).total == getattr(none, other).total, name
        assert p.moved == freed, name
    assert plans["optimizer+base+engine"].moved == stage.optimizer + stage.base + shard.weights
    # between the two phases' peaks: only the fewest offloads that fit are chosen
    limit = plans["engine"].peak
    chosen = best(plans.values(), limit)
    assert chosen.offloads.count == 1 and chosen.peak <= limit and not none.fits(limit)


def test_the_plan_names_the_best_loop_and_its_overrides(capsys):
    argv = [*PLAN, "--gpu-memory-gb", "80", "--seq-len", "256", "--engine-seqs", "4", "--layout", "tp=2"]
    assert main([*argv, "--engine-layout", "tp=2,dcp=2,ep=1", "--engine-layout", "tp=1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # the smaller engine TP wins when both fit with no offload
    assert last.startswith("best fitting layout: tp=2,pp=1,cp=1,ep=1,dp=1 + engine tp=1,dcp=1,ep=0, offload none")
    assert last.endswith(
        "parallel.tp=2 parallel.pp=1 parallel.cp=1 parallel.ep=1 parallel.dp=1 parallel.micro_batch_tokens=256 "
        "parallel.recompute=false rollout.tp=1 rollout.dcp=1 rollout.ep=false rollout.quantize=all "
        "rollout.dtype=bfloat16 model.train_dtype=bfloat16 rollout.memory_mb=1"
    )


@pytest.mark.parametrize(
    "argv, phase",
    [
        (["--graphs-gb", "1", "--seq-len", "256", "--gpu-memory-gb", "0.5"], "rollout"),  # the graphs alone: 1 GiB
        (["--graphs-gb", "0", "--seq-len", "4096", "--gpu-memory-gb", "0.01"], "training"),
    ],
)
def test_an_infeasible_gpu_exits_1_naming_the_fullest_phase(argv, phase, capsys):
    assert main([*PLAN, "--layout", "tp=2", "--engine-layout", "tp=2", "--engine-seqs", "1", *argv]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("no candidate layout fits, even with recompute and offloads") and (
        f"in its {phase} phase" in last
    ), last
