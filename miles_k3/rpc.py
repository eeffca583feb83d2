"""Calls replayed by name: the one command bus between a leader and the processes that mirror it.

Three places need it: the ranks > 0 of a sharded engine replay rank 0's engine calls (`rollout.engine.Engine`),
the trainer ranks > 0 of a local or external world replay the driver's trainer calls
(`miles_k3.trainer.backends.LocalRanks`), and a Ray rank actor runs the calls the driver sends it
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

from collections.abc import Callable
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


def _walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """`obj` rebuilt with `leaf(x)` for every value x inside its lists, tuples (named ones too) and dicts, in one
    fixed order (the sender's and the receivers' walks meet the tensors in the same order)."""
    if isinstance(obj, (list, tuple)):
        out = [_walk(x, leaf) for x in obj]
        return out if isinstance(obj, list) else type(obj)(out) if type(obj) is tuple else type(obj)(*out)
    if isinstance(obj, dict):
        return {k: _walk(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def _lift(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by a `_TensorSlot`, the tensors appended to `tensors` in walk order."""

    def slot(x: Any) -> Any:
        if not torch.is_tensor(x):
            return x
        tensors.append(x)
        return _TensorSlot(len(tensors) - 1, tuple(x.shape), x.dtype)

    return _walk(obj, slot)


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
        if self.data is None:
            return box[0]

        def receive(x: Any) -> Any:  # the walk meets the slots in the order the sender broadcast them
            if not isinstance(x, _TensorSlot):
                return x
            t = torch.empty(x.shape, dtype=x.dtype, device=self.device)
            dist.broadcast(t, src=self.src, group=self.data)
            return t

        return _walk(box[0], receive)
