"""Calls replayed by name: the one command bus between a leader and the processes that mirror it.

Three places need it: the ranks > 0 of a sharded engine replay rank 0's engine calls (`rollout.engine.Engine`),
the trainer ranks > 0 of a local or external world replay the driver's trainer calls
(`miles_k3.trainer.backends.LocalTrainers`), and a Ray actor runs the calls the driver sends it
(`miles_k3.trainer.ray_launch`). Each is the same thing: a call is `(name, args)`, and the receiving side runs
`getattr(target, name)(*args)` on its own object, for the names that object lists in its `REPLAYED` set.
No side keeps an if/elif per command or a hand-written twin of each method.

    leader = Leader(Broadcast(group))            # rank 0
    leader.call(target, "train", batch)          # runs here, and on every follower, in order
    ...
    leader.stop()

    follow(target, Broadcast(group))             # ranks > 0: returns when the leader stops

`Leader.record` queues a call without sending it (a sharded engine logs its submits and sends them with the
next step); `flush` sends the queue as one message. Tensors inside the arguments (at any depth of lists,
tuples and dicts) travel apart from the message when the transport has a data group: the message carries
their shape and dtype, each is broadcast over the data group afterwards, and a follower receives it into a
tensor of its own device, so an adapter moves at collective speed, not through pickling.

What a target may be asked: only the methods in its `REPLAYED` class attribute (a frozenset of names), so a
message can never call something the target did not offer; an unknown name is a RuntimeError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

STOP = "__stop__"  # the message that ends a follower's loop


class Transport(Protocol):
    """Moves one message (a list of calls) from the leader to every follower, in order."""

    def send(self, calls: list[tuple[str, tuple]]) -> None: ...
    def receive(self) -> list[tuple[str, tuple]]: ...


def dispatch(target: Any, name: str, args: tuple = ()) -> Any:
    """Run the call `name(*args)` on `target`, if its class offers it (`REPLAYED`)."""
    if name not in getattr(type(target), "REPLAYED", ()):
        raise RuntimeError(f"{type(target).__name__} does not take the call {name!r} (not in its REPLAYED set)")
    return getattr(target, name)(*args)


class Leader:
    """The side whose calls the others replay. `call` runs a call here and sends it at once; `record` queues a
    call that already ran here, `flush` sends the queue."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._queue: list[tuple[str, tuple]] = []

    def record(self, name: str, *args) -> None:
        self._queue.append((name, args))

    def flush(self) -> None:
        calls, self._queue = self._queue, []
        self.transport.send(calls)

    def call(self, target: Any, name: str, *args) -> Any:
        """Send the call to the followers, then run it here (a collective inside it then meets theirs)."""
        self.record(name, *args)
        self.flush()
        return dispatch(target, name, args)

    def stop(self) -> None:
        """End the followers' `follow` loops (queued calls are sent first)."""
        self.record(STOP)
        self.flush()


def follow(target: Any, transport: Transport) -> None:
    """Replay the leader's calls on `target`, message by message, until the leader stops."""
    while True:
        for name, args in transport.receive():
            if name == STOP:
                return
            dispatch(target, name, args)


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor sat in a message: its index in the data group's broadcasts, its shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _lift(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with every tensor (inside lists, tuples and dicts) replaced by a `_TensorSlot`, appended to
    `tensors`."""
    if torch.is_tensor(obj):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, (list, tuple)):
        out = [_lift(x, tensors) for x in obj]
        return out if isinstance(obj, list) else type(obj)(out) if type(obj) is tuple else type(obj)(*out)
    if isinstance(obj, dict):
        return {k: _lift(v, tensors) for k, v in obj.items()}
    return obj


def _slots(obj: Any, found: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _slots(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _slots(x, found)


def _lower(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`_lift` undone: each slot replaced by its received tensor."""
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, (list, tuple)):
        out = [_lower(x, tensors) for x in obj]
        return out if isinstance(obj, list) else type(obj)(out) if type(obj) is tuple else type(obj)(*out)
    if isinstance(obj, dict):
        return {k: _lower(v, tensors) for k, v in obj.items()}
    return obj


class Broadcast:
    """A `Transport` over torch.distributed: the message is broadcast from `src` (a global rank) as a pickled
    object over `control` (a gloo group, so it never waits on a device stream; None: the default group);
    with a `data` group, tensors in the arguments are broadcast over it instead of pickled, from `device`
    (the followers receive them on theirs). Every rank of the groups builds one with the same arguments."""

    def __init__(self, src: int = 0, control=None, data=None, device: torch.device | str = "cpu"):
        self.src, self.control, self.data, self.device = src, control, data, torch.device(device)

    def send(self, calls: list[tuple[str, tuple]]) -> None:
        import torch.distributed as dist

        tensors: list[torch.Tensor] = []
        message = _lift(calls, tensors) if self.data is not None else calls
        dist.broadcast_object_list([message], src=self.src, group=self.control)
        for t in tensors:
            dist.broadcast(t.to(self.device).contiguous(), src=self.src, group=self.data)

    def receive(self) -> list[tuple[str, tuple]]:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.control)
        message = box[0]
        if self.data is None:
            return message
        slots: list[_TensorSlot] = []
        _slots(message, slots)
        tensors = []
        for slot in sorted(slots, key=lambda s: s.index):
            t = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
            dist.broadcast(t, src=self.src, group=self.data)
            tensors.append(t)
        return _lower(message, tensors)
