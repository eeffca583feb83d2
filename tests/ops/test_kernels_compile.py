"""`miles_k3.kernels.compile_check` compiles a recorded launch for sm_90 on a machine without a GPU, and
catches what Triton's interpreter lets through: a name rebound to another shape inside a branch (the short
conv's bug that cost a device call, 2026-12-02) runs interpreted and fails here. Its use on every kernel the
engine launches: tests/rollout/test_engine_kernels.py."""

import json
import os
import subprocess
import sys
import textwrap

_KERNELS = textwrap.dedent("""
    import triton
    import triton.language as tl

    @triton.jit
    def rebinds(x_ptr, n, B: tl.constexpr):
        p = tl.arange(0, 1)
        if n > 0:
            p = tl.arange(0, B)  # [1] becomes [B] in a branch: the interpreter runs it, the compiler does not
        tl.store(x_ptr + p, p.to(tl.float32))

    @triton.jit
    def scales(x_ptr, y_ptr, n, s, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * s, mask=i < n)
""")


def _spec(kernel, args, **kwargs):
    return {"kernel": f"bad_and_good:{kernel}", "args": args, "kwargs": kwargs}


def test_the_check_compiles_a_sound_kernel_and_names_the_one_the_interpreter_lets_through(tmp_path):
    (tmp_path / "bad_and_good.py").write_text(_KERNELS)
    specs = [
        _spec("scales", [{"dtype": "bfloat16"}, {"dtype": "float32"}, 100, 0.5], B=64),
        _spec("rebinds", [{"dtype": "float32"}, 7], B=16),
    ]
    (tmp_path / "launches.json").write_text(json.dumps(specs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd()])
    proc = subprocess.run(
        [sys.executable, "-m", "miles_k3.kernels.compile_check", "launches.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert any(ln.startswith("ok   bad_and_good:scales(B=64)") for ln in lines), proc.stdout
    assert any(ln.startswith("FAIL bad_and_good:rebinds(B=16)") for ln in lines), proc.stdout
    assert "initial value for `p`" in proc.stdout
    assert lines[-1] == "1/2 specializations compile for sm_90"


def test_the_check_refuses_an_interpreter_process(tmp_path):
    (tmp_path / "launches.json").write_text("[]")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "miles_k3.kernels.compile_check", str(tmp_path / "launches.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("compile_check: ") and "Traceback" not in proc.stderr
    assert "without TRITON_INTERPRET=1" in proc.stderr
