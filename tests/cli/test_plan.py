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
