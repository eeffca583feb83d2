#!/usr/bin/env bash
# Set up a CPU development environment in .venv (Python 3.11+): the CPU build of torch first, so the
# project's torch requirement is already met and no multi-GB CUDA build is pulled, then the project.
# Then Slurm for tests/slurm, which start a throw-away cluster of their own (tests/slurm/cluster.py):
# Debian's packages where apt-get and root are available (MILES_K3_SETUP_SLURM=0 skips it); elsewhere the
# environment still sets up and those tests skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[dev]"
echo "miles-k3 installed in .venv"

# real SGLang 0.5.23 for CPU in its own venv (.venv-sglang), for tests/trainer/test_sglang_server.py (the HTTP
# backend against a real SGLang server); MILES_K3_SETUP_SGLANG=0 skips it (those tests then skip, saying why)
if [ "${MILES_K3_SETUP_SGLANG:-1}" = 0 ]; then
    echo "SGLang: skipped (MILES_K3_SETUP_SGLANG=0); tests/trainer/test_sglang_server.py will skip"
else
    bash scripts/setup_sglang.sh
fi

slurm_packages=(slurmctld slurmd slurm-client munge)
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if [ "${MILES_K3_SETUP_SLURM:-1}" = 0 ]; then
    echo "Slurm: skipped (MILES_K3_SETUP_SLURM=0); tests/slurm will skip"
elif have slurmctld && have slurmd && have munged && have sbatch; then
    echo "Slurm: already installed"
elif [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "Slurm: not installed (needs root and apt-get: ${slurm_packages[*]}); tests/slurm will skip"
else
    # the daemons are never started as services here (no systemd in CI); the tests start their own
    export DEBIAN_FRONTEND=noninteractive
    apt_install() { apt-get install -y -q --no-install-recommends "${slurm_packages[@]}" >/dev/null; }
    if apt_install || { apt-get update -q >/dev/null && apt_install; }; then
        echo "Slurm: installed ($(slurmd -V))"
    else
        echo "Slurm: apt-get could not install ${slurm_packages[*]}; tests/slurm will skip"
    fi
fi
