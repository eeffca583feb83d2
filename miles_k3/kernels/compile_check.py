"""Compile recorded kernel launches for a CUDA architecture on a machine without a GPU.

Triton's interpreter, which the CPU tests run every kernel through, executes a kernel's Python without the
compiler's type rules: a name rebound to another shape or dtype inside a branch runs there and does not
compile on the device (2026-12-02: the short conv's state loop reused a [BT] tile's names for [BD] ones and
cost a whole device call). So the interpreted tests record the launches they make
(`miles_k3.kernels.interpreted_launches(record=...)`, as `launch_spec`s) and this module compiles each
recorded specialization with Triton's own compiler down to a cubin for the target (sm_90: the H200) through
the ptxas Triton ships: nothing launches, no GPU needed.

It must run in a process without TRITON_INTERPRET (there `triton.jit` gives compilable functions):

    python -m miles_k3.kernels.compile_check launches.json [--arch 90]

prints one line per distinct specialization and exits 1 if any failed to compile.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

import torch


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"kernel argument of type {type(value).__name__} cannot be recorded for compilation")


def launch_spec(fn: Any, args: tuple, kwargs: dict) -> dict:
    """A JSON-able record of one launch of the @triton.jit function `fn` (the interpreter's
    `InterpretedFunction` or a `JITFunction`): where the kernel lives, each argument's dtype (tensors) or
    value (scalars, which Triton specializes on) and the constexpr keywords."""
    inner = fn.fn
    kw = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    return {
        "kernel": f"{inner.__module__}:{inner.__qualname__}",
        "args": [_encode(a) for a in args],
        "kwargs": {k: _encode(v) for k, v in kw.items()},
    }


def _decode(value: Any) -> Any:
    from triton.runtime.jit import MockTensor

    if isinstance(value, dict) and "dtype" in value:
        return MockTensor(getattr(torch, value["dtype"]))  # data_ptr 0: aligned, as the allocator's are
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    return value


class _CompileOnlyDriver:
    """The piece of Triton's active driver that `JITFunction.warmup` asks for, answering with `arch`: the
    compiler then targets it without a device present."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _kernel(name: str) -> Any:
    module, qualname = name.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def compile_launches(specs: list[dict], arch: int = 90) -> dict[str, str | None]:
    """Compile every distinct spec for sm_`arch`; returns {description: None if it compiled, else the
    compiler's error (its last line and the source line it points at)}."""
    import os

    from triton.runtime import driver

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check needs a process without TRITON_INTERPRET=1 (kernels must be compilable)")
    results: dict[str, str | None] = {}
    specs = list({json.dumps(s, sort_keys=True): s for s in specs}.values())
    kernels = {name: _kernel(name) for name in {s["kernel"] for s in specs}}  # imported before the target is
    # set: a module that probes the device at import (fla asks torch.cuda for its name on an NVIDIA target)
    # must see the machine it runs on
    previous = driver._active  # not `reset_active()`: on a machine without a GPU that builds a driver and fails
    driver.set_active(_CompileOnlyDriver(arch))
    try:
        for spec in specs:
            consts = ", ".join(f"{k}={v}" for k, v in spec["kwargs"].items() if not isinstance(v, dict))
            label = f"{spec['kernel']}({consts})"
            try:
                kernels[spec["kernel"]].warmup(
                    *map(_decode, spec["args"]), grid=(1,), **{k: _decode(v) for k, v in spec["kwargs"].items()}
                )
                results[label] = None
            except Exception as e:  # noqa: BLE001 - the compiler's errors have no common base
                lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
                results[label] = f"{type(e).__name__}: {' | '.join(lines[-6:])}"
    finally:
        driver._active = previous
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("launches", help="JSON list of launch specs (miles_k3.kernels.interpreted_launches)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90: H100/H200)")
    args = parser.parse_args(argv)
    try:
        with open(args.launches) as f:
            specs = json.load(f)
        results = compile_launches(specs, args.arch)
    except (OSError, ValueError, RuntimeError) as e:  # a missing or malformed file; an interpreter process
        parser.exit(2, f"compile_check: {e}\n")
    for label, error in results.items():
        print(f"{'ok  ' if error is None else 'FAIL'} {label}" + ("" if error is None else f"\n     {error}"))
    failed = sum(e is not None for e in results.values())
    print(f"{len(results) - failed}/{len(results)} specializations compile for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
