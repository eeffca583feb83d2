"""Run a check script under Triton's interpreter (CPU) in a fresh interpreter process.

TRITON_INTERPRET must be set before a kernel is defined, and other tests import triton (through fla)
first, so kernel checks run in a subprocess. The script prints "ok" last when every assertion held."""

import os
import subprocess
import sys


def assert_interpreted_ok(script: str, timeout: int) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
