"""Run a check script under Triton's interpreter (CPU) in a fresh interpreter process, and compile the
launches it recorded for sm_90 (`miles_k3.kernels.compile_check`).

TRITON_INTERPRET must be set before a kernel is defined, and other tests import triton (through fla)
first, so kernel checks run in a subprocess. The script prints "ok" last when every assertion held."""

import json
import os
import subprocess
import sys


def assert_interpreted_ok(script: str, timeout: int) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def run_and_compile(script: str, tmp_path) -> list[str]:
    """Run `script` under Triton's interpreter (it records its launches to $LAUNCHES_JSON), then compile every
    launch for sm_90 with Triton's own compiler. -> the launched kernels' names, in order."""
    path = tmp_path / "launches.json"
    os.environ["LAUNCHES_JSON"] = str(path)
    try:
        assert_interpreted_ok(script, timeout=300)
    finally:
        del os.environ["LAUNCHES_JSON"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "miles_k3.kernels.compile_check", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [spec["kernel"].split(":")[1] for spec in json.loads(path.read_text())]
