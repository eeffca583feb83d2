"""Host values to device tensors, and device values to the host, without waiting for the device.

A blocking host-to-device copy (`torch.tensor(values, device=cuda)`) synchronizes the stream first, so
the host would stall until every enqueued step finished: exactly what the overlap schedule
(`rollout.decode`) must avoid. `cudaMemcpyAsync` from pageable memory stages the bytes and returns
without a device sync, and the copy stays ordered on the stream before the kernels that read it.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list, nested lists, or a CPU tensor) as a tensor on `device`, enqueued asynchronously."""
    host = values if torch.is_tensor(values) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    return host.to(device, non_blocking=True)


def to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """x's values on the host without waiting for them: a CUDA tensor is copied into pinned memory
    asynchronously, with an event that marks the copy (synchronize it before reading); a CPU tensor is
    returned as it is, with no event."""
    if not x.is_cuda:
        return x, None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
