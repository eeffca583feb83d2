"""Tensors parked on the host between the phases that need them: a colocated RL loop trains and rolls out on
the same devices, so the side that is idle gives its memory to the other (the engine's weights during
training, the trainer's frozen base and optimizer state during rollout).

    parked = Parked(model.parameters())   # every distinct storage copied to host, its device memory freed
    ...                                   # the tensors keep their shapes; reading them now is an error
    parked.restore()                      # the same storages, the same bytes, back on the device

Storages, not tensors, are the unit: views that share one storage (stacked expert projections, a packed
row and its members) stay views of it, and a storage is parked once however many tensors view it. A storage
keeps its identity (only its size goes to zero and back), so modules, optimizers and views that hold the
tensors need no rebinding; what read a freed storage's address (CUDA graphs) must be rebuilt after restore,
as after any release. `resident_bytes` is the allocator's view of a set of tensors: the bytes their distinct
storages hold now.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct, allocated, non-meta storages under `tensors`, in first-seen order."""
    seen, out = set(), []
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        key = (s.device, s.data_ptr())
        if s.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(s)
    return out


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the distinct storages under `tensors` hold now (0 for a parked one)."""
    return sum(s.nbytes() for s in _storages(tensors))


class Parked:
    """The storages under `tensors` copied to host memory (pinned when they live on a GPU) and freed on their
    device until `restore`. Parking nothing (an empty iterable) is allowed; `restore` twice is an error."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        for s in _storages(tensors):
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=s.device.type == "cuda")
            host.copy_(torch.tensor([], dtype=torch.uint8, device=s.device).set_(s), non_blocking=True)
            self._held.append((s, host))
        if any(s.device.type == "cuda" for s, _ in self._held):
            torch.cuda.synchronize()  # the copies are done before the memory goes
        for s, _ in self._held:
            s.resize_(0)
        self.nbytes = sum(h.numel() for _, h in self._held)

    def restore(self) -> None:
        if self._held is None:
            raise RuntimeError("Parked.restore: already restored")
        for s, host in self._held:
            s.resize_(host.numel())
            torch.tensor([], dtype=torch.uint8, device=s.device).set_(s).copy_(host, non_blocking=True)
        if any(s.device.type == "cuda" for s, _ in self._held):
            torch.cuda.synchronize()
        self._held = None
