"""The driver's two seams: one rollout backend and one trainer group.

`GRPODriver` (`miles_k3.trainer.loop`) sees the engines only as a `RolloutBackend` and the trainer ranks only
as a `TrainerGroup`; where they live (this process, other processes, Ray actors, a server behind HTTP) is the
backend's business. A launcher builds one of each:

    local / external   `LocalEngine` (the engine in rank 0's process) + `LocalTrainers` (rank 0 here, the
                       other ranks replaying its calls by name: `miles_k3.rpc`)
    ray                `RayEngines` + `RayTrainers` (`miles_k3.trainer.ray_launch`)

A backend generates into the driver's `Sample` records (`miles_k3.data.sample`): the driver makes one per
sample (prompt ids, its images, its place in its group) and the backend fills in the engine's output and
returns them, the same objects or their filled copies, in order. Optional abilities are capabilities, not
methods every backend stubs: a backend lists them in `CAPABILITIES` (read by `resolve` at config time,
before anything is built, so a run asking for one its backend lacks fails by field name) and offers each as
an object (`drafter()`, `plugins()`), None when absent.

Adding a backend (engine groups sharded over several ranks, engines on their own devices, an SGLang fleet
behind HTTP) is one subclass and its entry in `ROLLOUT_BACKENDS`, the choice a launcher (or a future
`rollout.backend` key, once one launcher offers two) picks it by.

When each call is safe: the driver calls one method at a time from one thread. `generate` / a plugin run
only while the engines hold their memory (after `resume`, or before any `release`); `sync_adapter` only
between rollouts, with nothing in flight; `release` only between rollouts; `counters` at any time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from miles_k3 import rpc
from miles_k3.data.sample import Sample

if TYPE_CHECKING:
    from miles_k3.trainer.batch import TrainBatch
    from miles_k3.trainer.rollout_plugin import RolloutJob
    from miles_k3.trainer.rollout_worker import RolloutWorker
    from miles_k3.trainer.train_worker import TrainWorker
    from rollout.request import SamplingParams
    from rollout.spec.distill import DistillConfig

ROLLOUT_FN = "rollout_fn"  # capability: runs rollout.fn plugins against the engine (multi-turn)
DRAFTER = "drafter"  # capability: distils the engine's speculative drafter online


class Drafter(Protocol):
    """The engine's DSpark drafter as the driver steers it (capability `DRAFTER`)."""

    def distill_drafter(
        self, sequences: list[tuple[int, list[int]]], config: DistillConfig, seed: int
    ) -> dict[str, float]: ...
    def drafter_state(self) -> dict | None: ...
    def load_drafter_state(self, state: dict, config: DistillConfig) -> None: ...


class Plugins(Protocol):
    """Runs rollout functions against the engine (capability `ROLLOUT_FN`)."""

    def rollout(
        self, fn: str, jobs: list[RolloutJob], *, tokenizer: tuple[str, str | None], client: str
    ) -> list[Sample]: ...


class RolloutBackend(ABC):
    """The engines of a run, as the driver sees them (module docstring)."""

    CAPABILITIES: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def generate(self, samples: list[Sample], params: list[SamplingParams]) -> list[Sample]:
        """Each sample's completion of its `prompt_ids` (with its `media`) under the policy adapter and its own
        params: `output_ids`, `logprobs`, `loss_mask` (all True), `finish_reason`; returned in order."""

    @abstractmethod
    def release(self) -> None:
        """Free the engines' KV and state memory for the trainer (between rollouts)."""

    @abstractmethod
    def resume(self) -> None:
        """Take the memory back (a no-op when it was not released)."""

    @abstractmethod
    def sync_adapter(self, tensors: dict[str, torch.Tensor]) -> float:
        """The trainer's adapter (full tensors in engine naming) into every engine's policy slot; milliseconds."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Cumulative engine counters, summed over engines (the driver logs each step's difference)."""

    def shutdown(self) -> None:
        """Stop what the backend started (the default: nothing)."""

    def drafter(self) -> Drafter | None:
        """The `DRAFTER` capability, or None."""
        return None

    def plugins(self) -> Plugins | None:
        """The `ROLLOUT_FN` capability, or None."""
        return None


class TrainerGroup(ABC):
    """The trainer ranks of a run, as the driver sees them: every call runs on every rank (the collectives
    inside it need them all) and returns rank 0's result."""

    @abstractmethod
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO update over the batch (`TrainWorker.train`); the batch's metrics."""

    @abstractmethod
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The full adapter in engine naming (gathered over the ranks that shard it)."""

    @abstractmethod
    def states(self) -> list[dict[str, Any]]:
        """Every rank's checkpoint state (adapter shards, optimizer, RNG), in rank order."""

    @abstractmethod
    def load_states(self, states: list[dict[str, Any]], adapter: dict[str, torch.Tensor]) -> None:
        """Continue from `states()`'s result: each rank takes its own."""

    def shutdown(self) -> None:
        """Release the ranks (the default: nothing)."""


# ---------------------------------------------------------------------------------------------- engine
class LocalEngine(RolloutBackend):
    """One engine in this process (the local and external launchers' rank 0)."""

    CAPABILITIES = frozenset({ROLLOUT_FN, DRAFTER})

    def __init__(self, worker: RolloutWorker):
        self.worker = worker

    def generate(self, samples, params):
        return self.worker.generate(samples, params)

    def release(self) -> None:
        self.worker.release_memory()

    def resume(self) -> None:
        self.worker.resume_memory()

    def sync_adapter(self, tensors) -> float:
        return self.worker.sync_adapter(tensors)

    def counters(self) -> dict[str, int]:
        return self.worker.engine_counters()

    def drafter(self) -> Drafter:
        return self.worker

    def plugins(self) -> Plugins:
        return self.worker


# ----------------------------------------------------------------------------------------- trainers
class TrainerRank:
    """One trainer rank as the group's calls reach it: the same method runs on every rank (by name, through
    `miles_k3.rpc`: replayed from the driver's rank 0 in a local world, sent to each actor under Ray), and
    the collectives in it (the update's, the checkpoint's gather and scatter) meet across the ranks."""

    REPLAYED = frozenset({"train", "adapter_state", "states", "load_states"})

    def __init__(self, worker: TrainWorker, rank: int, world_size: int):
        self.worker, self.rank, self.world_size = worker, rank, world_size

    def train(self, batch: TrainBatch) -> dict[str, float]:
        return self.worker.train(batch)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self.worker.adapter_state()

    def states(self) -> list[dict[str, Any]] | None:
        """Every rank's state, gathered on rank 0 (None on the others)."""
        mine = self.worker.state_dict()
        if self.world_size == 1:
            return [mine]
        states: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, states, dst=0)
        return states

    def load_states(self, adapter: dict[str, torch.Tensor], states: list[dict[str, Any]] | None = None) -> None:
        """Rank 0 passes every rank's state and each rank receives only its own (a scatter)."""
        if self.world_size == 1:
            self.worker.load_state_dict(states[0], adapter)
            return
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, states if self.rank == 0 else None, src=0)
        self.worker.load_state_dict(mine[0], adapter)


class LocalTrainers(TrainerGroup):
    """Trainer rank 0 in this process; ranks 1..N-1 (other processes of the world) replay its calls in
    `follow_trainer` until `shutdown`."""

    def __init__(self, worker: TrainWorker, world_size: int = 1):
        self.rank = TrainerRank(worker, 0, world_size)
        self.leader = rpc.Leader(rpc.Broadcast(0)) if world_size > 1 else None

    def _call(self, name: str, *args):
        if self.leader is None:
            return rpc.dispatch(self.rank, name, args)
        return self.leader.call(self.rank, name, *args)

    def train(self, batch):
        return self._call("train", batch)

    def adapter_state(self):
        return self._call("adapter_state")

    def states(self):
        return self._call("states")

    def load_states(self, states, adapter) -> None:
        if self.leader is not None:  # the others receive their own state from the scatter, not the message
            self.leader.record("load_states", adapter)
            self.leader.flush()
        self.rank.load_states(adapter, states)

    def shutdown(self) -> None:
        if self.leader is not None:
            self.leader.stop()


def follow_trainer(worker: TrainWorker, rank: int, world_size: int) -> None:
    """Ranks > 0 of a local or external world: run rank 0's trainer calls until it shuts the group down."""
    rpc.follow(TrainerRank(worker, rank, world_size), rpc.Broadcast(0))


# the rollout backend each launcher builds, as "module:class" (imported when asked: Ray's only under Ray)
ROLLOUT_BACKENDS = {
    "local": "miles_k3.trainer.backends:LocalEngine",
    "external": "miles_k3.trainer.backends:LocalEngine",
    "ray": "miles_k3.trainer.ray_launch:RayEngines",
}


def backend_class(launcher: str) -> type[RolloutBackend]:
    """The rollout backend class of `cluster.launcher` (its `CAPABILITIES` are what `resolve` checks)."""
    import importlib

    module, name = ROLLOUT_BACKENDS[launcher].split(":")
    return getattr(importlib.import_module(module), name)
