"""The one command bus (`miles_k3.rpc`): calls replayed by name, tensors moved apart from the message, only
the names a target offers."""

import io
import os
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_k3 import rpc


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


class Recorder:
    REPLAYED = frozenset({"put", "add"})

    def __init__(self):
        self.calls = []

    def put(self, name, tensors, pair):
        self.calls.append(("put", name, {k: v.clone() for k, v in tensors.items()}, pair))
        return len(self.calls)

    def add(self, x, y):
        self.calls.append(("add", x, y))
        return x + y

    def secret(self):  # a public method not offered to the bus
        raise AssertionError("must not be reachable by a message")


def test_tensors_leave_the_message_and_come_back_in_place():
    tensors = []
    call = ("put", ("w", {"x": torch.ones(2, 3), "y": [torch.zeros(1), 5]}, Pair(torch.arange(4), 7)))
    lifted = rpc._lift(call, tensors)
    assert len(tensors) == 3 and not any(torch.is_tensor(x) for x in _leaves(lifted))
    slots = [x for x in _leaves(lifted) if isinstance(x, rpc._TensorSlot)]
    assert [s.shape for s in slots] == [(2, 3), (1,), (4,)] and [s.index for s in slots] == [0, 1, 2]
    back = rpc._walk(lifted, lambda x: tensors[x.index].clone() if isinstance(x, rpc._TensorSlot) else x)
    assert isinstance(back[1][2], Pair) and back[1][2].b == 7 and torch.equal(back[1][2].a, torch.arange(4))
    assert torch.equal(back[1][1]["x"], torch.ones(2, 3)) and back[1][1]["y"][1] == 5


def _leaves(obj):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _leaves(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _leaves(x)
    else:
        yield obj


def test_a_target_takes_only_the_calls_it_offers():
    r = Recorder()
    assert rpc.dispatch(r, "add", (2, 3)) == 5
    for name in ("secret", "__init__", "calls"):
        with pytest.raises(RuntimeError, match=f"does not take the call '{name}'"):
            rpc.dispatch(r, name, ())


def _replay(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        data = dist.new_group([0, 1])
        transport = rpc.Broadcast(0, data=data)
        target = Recorder()
        if rank == 0:
            leader = rpc.Leader(transport)
            assert leader.call(target, "add", 1, 2) == 3
            leader.record(
                "put", "adapter", {"A": torch.full((2, 2), 1.5), "B": torch.arange(3.0)}, Pair(torch.tensor([9]), 1)
            )
            leader.record("add", 10, 20)
            leader.flush()  # two calls, one message
            leader.stop()
        else:
            rpc.follow(target, transport)
            buf = io.BytesIO()  # bytes, not shared tensors: this process ends before the parent reads
            torch.save(target.calls, buf)
            out.put(buf.getvalue())
    finally:
        dist.destroy_process_group()


def test_a_follower_replays_the_leaders_calls_in_order_with_their_tensors():
    from megatron_patches.parallel import free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_replay, args=(free_port(), out), nprocs=2, join=True)
    calls = torch.load(io.BytesIO(out.get()), weights_only=False)
    assert [c[0] for c in calls] == ["add", "put", "add"]
    assert calls[0] == ("add", 1, 2) and calls[2] == ("add", 10, 20)
    _, name, tensors, pair = calls[1]
    assert name == "adapter" and torch.equal(tensors["A"], torch.full((2, 2), 1.5))
    assert torch.equal(tensors["B"], torch.arange(3.0)) and torch.equal(pair.a, torch.tensor([9])) and pair.b == 1
