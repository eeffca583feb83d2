"""Triton kernels for the definition's ops (`miles_k3.ops`): the same math in fewer launches, for the steps
where launches are the cost (the engine's decode step is about one kernel per op, 2-3 us each inside a CUDA
graph, so at batch 1 its time tracks their number).

The seam is `use_kernels`: an op of `miles_k3.ops` runs its kernel where it says yes and its torch
definition otherwise, so the definition stays the reference every kernel is tested against and the only
path autograd sees (the kernels have no backward). Each kernel module states its contract (shapes, strides,
dtypes, how close to the definition) in its docstring, and its test holds it on CPU through Triton's
interpreter (`tests/rollout/interpreted.py`).

`MILES_K3_KERNELS`:
- unset or "auto": kernels on CUDA tensors under inference mode (the engine's steps), the definition
  elsewhere (the trainer, autograd on or off, and every CPU tensor);
- "0": the definition everywhere (an A/B switch, and the way out if a kernel misbehaves on a new device);
- "interpret": kernels on CPU tensors too, under inference mode; needs TRITON_INTERPRET=1 set before triton is
  imported (else the kernels cannot run on CPU tensors and this is an error): how the CPU tests run a whole
  engine through the kernel path, and how `scripts/count_decode_ops.py --kernels` counts the CUDA step's ops.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from miles_k3.ops import exact

MODES = ("auto", "0", "interpret")


@functools.cache
def _mode() -> str:
    mode = os.environ.get("MILES_K3_KERNELS", "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"MILES_K3_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    if mode != "0":
        try:
            import triton  # noqa: F401
        except ImportError:  # a CPU install without triton: the definition everywhere
            return "0"
    if mode == "interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("MILES_K3_KERNELS=interpret needs TRITON_INTERPRET=1 in the environment before start")
    return mode


def use_kernels(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs its Triton kernel (module docstring). Only under `torch.inference_mode`,
    which the engine's steps run in: a kernel's output has no grad_fn, so it may not stand in a graph being
    recorded, and the trainer's no-grad passes (old and reference log-probs) must compute with the same ops
    as its training forward, whose ratio to them is exactly 1 where the policy has not moved. Nor while
    torch.compile traces (the engine's opt-in compiled decode step): inductor fuses the definition's
    elementwise chains itself, and dynamo would otherwise have to trace each kernel's launch."""
    if not torch.is_inference_mode_enabled() or torch.compiler.is_compiling() or exact.enabled():
        return False  # exact mode: the definition on both sides (miles_k3.ops.exact)
    return available(x.device)


def available(device: torch.device | str) -> bool:
    """Whether `use_kernels` can say yes for tensors on `device` (under inference mode): the check for a
    setting that asks for a kernel, before any model step runs."""
    mode = _mode()
    return mode == "interpret" or (mode == "auto" and torch.device(device).type == "cuda")


def reset() -> None:
    """Forget the cached mode (tests that set MILES_K3_KERNELS)."""
    _mode.cache_clear()


@contextlib.contextmanager
def interpreted_launches(record: list | None = None) -> Iterator[collections.Counter]:
    """Count Triton kernel launches by kernel name while inside, under the interpreter (TRITON_INTERPRET=1),
    and run each inside a profiler range "triton::<name>": a launch is one CUDA kernel, and the range tells
    it apart from the aten ops the interpreter runs for it (copying the arguments to and from host tensors).
    Used by `scripts/count_decode_ops.py --kernels` and the dispatch tests. It wraps the interpreter's one
    launch entry (`InterpretedFunction.run`), so every kernel counts, whoever wrote it. With `record`, each
    launch's `compile_check.launch_spec` is appended to it, for compiling them for the device afterwards (the
    interpreter does not apply the compiler's type rules: `miles_k3.kernels.compile_check`)."""
    from triton.runtime.interpreter import InterpretedFunction

    from miles_k3.kernels.compile_check import launch_spec

    counts: collections.Counter = collections.Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if kwargs.get("warmup"):  # a compile-only call: no launch (the interpreter returns at once)
            return run(self, *args, **kwargs)
        counts[self.__name__] += 1
        if record is not None:
            record.append(launch_spec(self, args, kwargs))
        with torch.profiler.record_function(f"triton::{self.__name__}"):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield counts
    finally:
        InterpretedFunction.run = run
