#!/usr/bin/env bash
# Install real SGLang 0.5.23 for CPU into its own venv, .venv-sglang at the repo root (its transformers pin stays
# out of .venv), for tests/trainer/test_sglang_server.py: the HTTP rollout backend against a real SGLang server
# on a tiny random Qwen2 (K3 itself cannot run there: fla's KDA kernels need CUDA).
#
# SGLang's wheel names CUDA builds among its requirements, so it is installed with --no-deps, followed by the
# pure-Python packages its HTTP server and scheduler import, on the CPU build of torch. Then three patches in
# that venv's site-packages, each applied once and failing loudly when its target text is missing:
#   - torchvision's PyPI wheel is a CUDA build whose ops do not load on CPU torch: its two `register_fake`
#     registrations of those ops (torchvision/_meta_registrations.py) are skipped;
#   - SGLang's LoRA code asks for pinned host memory unconditionally, which CPU torch refuses: pinning is off;
#   - no CPU build of sgl_kernel is on PyPI: a stand-in package that imports (with the torch_native attention
#     and sampling backends none of its functions is called; each raises NotImplementedError if one ever is).
# Run a server with SGLANG_USE_CPU_ENGINE=1 and `--device cpu --attention-backend torch_native
# --sampling-backend pytorch --disable-overlap-schedule --dtype float32 --skip-server-warmup`.
# Rerunning on a finished install returns at once (a marker file in the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
MARKER=$VENV/.miles-k3-sglang-0.5.23
if [ -f "$MARKER" ]; then
    echo "SGLang 0.5.23 (CPU): already installed in $VENV"
    exit 0
fi
start=$(date +%s)
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
pip=($VENV/bin/python -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0  # the CPU build first: nothing after it may replace it
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==2.13.0" >"$pin"
"${pip[@]}" -c "$pin" \
    transformers==5.19.0 tokenizers==0.23.2 xgrammar==0.2.7 compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 \
    blobfile==3.0.0 sentencepiece==0.2.1 openai==2.8.0 openai-harmony==0.0.4 "llguidance>=1.7.6,<2" \
    aiohttp distro easydict einops fastapi gguf interegular IPython msgspec ninja numpy orjson packaging \
    partial_json_parser pillow prometheus-client psutil pybase64 pydantic "python-dateutil<3" python-multipart \
    "pyzmq>=25.1.2" regex requests scipy setproctitle tiktoken tqdm "uvicorn>=0.51" uvloop watchfiles xxhash \
    zstandard dill jsonschema soundfile \
    triton==3.7.1  # imported unconditionally, never run on CPU
"${pip[@]}" --no-deps torchvision==0.28.0  # the release built against torch 2.13.0
# last, so pip's check of the packages above does not list the CUDA builds SGLang names (torch 2.14.1, ...)
"${pip[@]}" --no-deps sglang==0.5.23

$VENV/bin/python - <<'EOF'
"""The CPU patches (header of scripts/setup_sglang.sh), in this venv's site-packages."""

import sysconfig
from pathlib import Path

site = Path(sysconfig.get_paths()["purelib"])
MARK = "# miles-k3 (scripts/setup_sglang.sh):"


def patch(rel: str, old: str, new: str, count: int = 1) -> None:
    """Replace `old` by `new` in site-packages/`rel`, where it occurs exactly `count` times; done once."""
    path = site / rel
    text = path.read_text()
    if new in text and old not in text:
        return
    if text.count(old) != count:
        raise SystemExit(f"setup_sglang: {rel}: expected {count} of {old!r}, found {text.count(old)}")
    path.write_text(text.replace(old, new))


for op in ("nms", "qnms"):  # the op itself is in the CUDA build's library, which does not load on CPU torch
    patch(
        "torchvision/_meta_registrations.py",
        f'@torch.library.register_fake("torchvision::{op}")\n',
        f"{MARK} torchvision::{op} is not registered on CPU torch; its fake kernel is not either\n",
    )

# the LoRA layers' offsets and the torch_native LoRA backend's batch info (the backend the CPU test uses); pinned
# memory only speeds host-to-GPU copies, which CPU has none of
patch("sglang/srt/lora/layers.py", "pin_memory=True,", "pin_memory=False,", count=5)
patch("sglang/srt/lora/backend/torch_backend.py", "pin_memory=True", "pin_memory=False", count=3)
patch("sglang/srt/lora/layers.py", ".pin_memory()", ".clone()")  # pin_memory() copies: so does clone()
patch("sglang/srt/lora/backend/torch_backend.py", ".pin_memory()", ".clone()", count=4)

stub = site / "sgl_kernel" / "__init__.py"
stub.parent.mkdir(exist_ok=True)
stub.write_text(f'''{MARK} a stand-in for sgl_kernel, which has no CPU build on PyPI.
"""Import-only: `from sgl_kernel[.any.submodule] import name` succeeds, and calling `name` (or any attribute
of it) raises NotImplementedError. With --device cpu, --attention-backend torch_native and --sampling-backend
pytorch, SGLang calls none of them."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Missing:
    """A name of sgl_kernel: calling it raises; its attributes are names too (`scalar_types.uint4b8`)."""

    def __init__(self, qualname):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in (scripts/setup_sglang.sh): {{self._qualname}} has no CPU build")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{{self._qualname}}.{{name}}")

    def __repr__(self):
        return f"<sgl_kernel stand-in {{self._qualname}}>"


def _getattr_for(module_name):
    def getattr_(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{{module_name}}.{{name}}")

    return getattr_


__getattr__ = _getattr_for(__name__)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _getattr_for(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
''')
EOF
touch "$MARKER"
echo "SGLang 0.5.23 (CPU) installed in $VENV in $(($(date +%s) - start)) s"
