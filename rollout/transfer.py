"""Host values to device tensors without waiting for the device.

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
