"""Megatron's pipeline schedules and p2p on CPU + gloo: redirect their hard-wired CUDA device choices.

megatron-core 0.16.1's `pipeline_parallel.schedules` allocates its token counter with `device="cuda"` and
`pipeline_parallel.p2p_communication` allocates every receive buffer (and the shape messages of
`variable_seq_lengths`) on `torch.cuda.current_device()` and calls `torch.cuda.synchronize()`. Both modules
reach these through their module-global name `torch`. `use_cpu_devices()` rebinds that name, in those two
modules only, to a stand-in that forwards everything to torch except: `torch.cuda.current_device()` answers
the CPU device, `torch.cuda.synchronize()` does nothing, and `device="cuda"` in a tensor factory means the
CPU. Megatron's files are not edited; the rest of the process sees the real torch.

On a machine with CUDA it does nothing (megatron's choices are right there). Idempotent.
"""

from __future__ import annotations

import types

import torch

_CPU = torch.device("cpu")


def _cpu_if_cuda(device):
    return _CPU if device is not None and torch.device(device).type == "cuda" else device


def _factory(fn):
    def on_cpu(*args, device=None, **kwargs):
        return fn(*args, device=_cpu_if_cuda(device), **kwargs)

    return on_cpu


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as the schedules see it on a CPU-only host."""

    def __init__(self):
        super().__init__("torch.cuda (megatron_patches.cpu_device)")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device=None) -> None:
        return None


class _TorchOnCpu(types.ModuleType):
    """`torch` as the schedules see it on a CPU-only host: CUDA device choices land on the CPU."""

    def __init__(self):
        super().__init__("torch (megatron_patches.cpu_device)")
        self.cuda = _CudaOnCpu()
        for name in ("empty", "zeros", "ones", "full", "tensor"):
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_PATCHED = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication")


def use_cpu_devices() -> bool:
    """Install the redirect in megatron's schedule and p2p modules when CUDA is unavailable. Returns whether
    the redirect is active."""
    if torch.cuda.is_available():
        return False
    import importlib

    for name in _PATCHED:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu()
    return True
