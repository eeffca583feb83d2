"""scripts/bench_decode_kernels.py needs CUDA: on a CPU machine it says so in one line (no traceback)."""

import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode_kernels.py"


def test_without_cuda_it_says_it_needs_cuda_in_one_line():
    proc = subprocess.run([sys.executable, str(_PATH)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip() == "bench_decode_kernels.py: needs CUDA (the kernels' CPU path is Triton's interpreter)"
    assert "Traceback" not in proc.stdout + proc.stderr
