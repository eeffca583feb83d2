#!/usr/bin/env bash
# Set up a CPU development environment in .venv (Python 3.11+): the CPU build of torch first, so the
# project's torch requirement is already met and no multi-GB CUDA build is pulled, then the project.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[dev]"
echo "miles-k3 installed in .venv"
