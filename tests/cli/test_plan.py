"""`miles-k3 plan`: bad arguments are one line naming the flag (exit 2); a k3-tiny plan prints a verdict."""

from __future__ import annotations

import pytest

from miles_k3.cli.main import main


@pytest.mark.parametrize("argv, flag", [
    (["--gpus", "0", "--gpu-memory-gb", "80"], "--gpus"),
    (["--gpus", "2", "--gpu-memory-gb", "-1"], "--gpu-memory-gb"),
    (["--gpus", "2", "--gpu-memory-gb", "80", "--layout", "tp=3"], "--layout"),
    (["--gpus", "2", "--gpu-memory-gb", "80", "--layout", "tp=2,pp=x"], "--layout"),
    (["--gpus", "2", "--gpu-memory-gb", "80", "--seq-len", "64", "--micro-batch-tokens", "32"], "--micro-batch-tokens"),
    (["--gpus", "2", "--gpu-memory-gb", "80", "--engine-memory-gb", "1", "--engine-seqs", "2"], "--engine-seqs"),
])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    assert main(["plan", "--preset", "k3-tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_tiny_plan_prints_a_fitting_layout(capsys):
    assert main(["plan", "--preset", "k3-tiny", "--gpus", "2", "--gpu-memory-gb", "80", "--seq-len", "256",
                 "--layout", "tp=2", "--layout", "pp=2", "--engine-seqs", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp=2,pp=1,cp=1,ep=1,dp=1: peak rank" in out and "FITS" in out
    assert "best fitting layout:" in out
