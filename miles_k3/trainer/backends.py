"""The driver's two seams: one rollout backend and one trainer group.

`GRPODriver` (`miles_k3.trainer.loop`) sees the engines only as a `RolloutBackend` and the trainer ranks only
as a `TrainerGroup`; where they live (this process, other processes, Ray actors, a server behind HTTP) is the
backend's business. A launcher builds one of each:

    local / external   `ColocatedEngines` + `ColocatedTrainers` over `LocalRanks`: every rank holds a trainer rank
                       and a shard of one engine replica (`ColocatedRank`: rollout.tp ranks a replica); rank 0
                       runs the driver and the others replay its calls by name (`miles_k3.rpc`)
    ray                the same over `RayRanks`: one actor per bundle holds a `ColocatedRank`
                       (`miles_k3.trainer.ray_launch`)
    rollout.backend=http   `HTTPEngines` (servers at rollout.urls) + `ColocatedTrainers` over ranks that are
                       trainers only (`TrainerRank`)

A backend generates into the driver's `Sample` records (`miles_k3.data.sample`): the driver makes one per
sample (prompt ids, its images, its place in its group) and the backend fills in the engine's output and
returns them, the same objects or their filled copies, in order. Optional abilities are capabilities, not
methods every backend stubs: a backend lists them in `CAPABILITIES` (read by `resolve` at config time,
before anything is built, so a run asking for one its backend lacks fails by field name) and offers each as
an object (`drafter()`, `plugins()`), None when absent.

Adding a backend is one subclass and its entry in `ROLLOUT_BACKENDS`, which `rollout.backend` picks by name:
`colocated` (above) or `http` (`miles_k3.trainer.http_engines.HTTPEngines`: miles-serve processes or an SGLang
deployment at rollout.urls).

When each call is safe: the driver calls one method at a time from one thread, except with
rollout.max_staleness > 0 (`http` only), where a second thread generates while the driver syncs, evaluates
and reads counters (`HTTPEngines` guards what they share). `generate` / a plugin run only while the engines
hold their memory (after `resume`, or before any `release`); a colocated `sync_adapter` only between
rollouts, with nothing in flight; `release` only between rollouts; `counters` at any time.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from miles_k3 import rpc
from miles_k3.data.sample import Sample
from miles_k3.trainer.adapter_sync import AdapterGather, AdapterSync
from miles_k3.trainer.rollout_plugin import ADAPTER

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
    def sync_adapter(self, trainer: TrainerGroup) -> dict[str, float]:
        """The trainer group's current adapter into every engine's policy slot (whole from
        `trainer.adapter_parts()`, or block by block where the engines share the trainer's ranks); the sync's
        metrics: `adapter_sync_ms`, and what the backend counts beside it (bytes moved)."""

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
    def adapter_parts(self) -> Iterator[dict[str, torch.Tensor]]:
        """The full adapter in engine naming, one part (a decoder layer's tensors) at a time, gathered from the
        ranks that own its blocks: what `save_peft` writes as it arrives, so no process holds it whole. Consume
        it to the end (every rank takes part in each part's gather)."""

    @abstractmethod
    def states(self) -> list[dict[str, Any]]:
        """Every rank's checkpoint state (adapter shards, optimizer, RNG), in rank order."""

    @abstractmethod
    def load_states(self, states: list[dict[str, Any]], adapter: dict[str, torch.Tensor]) -> None:
        """Continue from `states()`'s result: each rank takes its own."""

    def shutdown(self) -> None:
        """Release the ranks (the default: nothing)."""


# ----------------------------------------------------------------------------------------- trainers
class TrainerRank:
    """One trainer rank as the group's calls reach it: the same method runs on every rank (by name, through
    `miles_k3.rpc`: replayed from the driver's rank 0 in a local world, sent to each actor under Ray), and
    the collectives in it (the update's, the checkpoint's gather and scatter) meet across the ranks."""

    REPLAYED = frozenset({"train", "adapter_part_count", "adapter_part", "states", "load_states"})

    def __init__(self, worker: TrainWorker, rank: int, world_size: int):
        self.worker, self.rank, self.world_size = worker, rank, world_size
        self._parts: AdapterGather | None = None

    def train(self, batch: TrainBatch) -> dict[str, float]:
        return self.worker.train(batch)

    def adapter_part_count(self) -> int:
        if self._parts is None:  # the blocks' boxes never change: planned once
            self._parts = AdapterGather(self.worker.adapter_shards())
        return len(self._parts.parts)

    def adapter_part(self, i: int) -> dict[str, torch.Tensor] | None:
        """Part `i` of the adapter, whole, on rank 0 (`adapter_sync.AdapterGather`; None elsewhere)."""
        self.adapter_part_count()
        return self._parts.part(i, self.worker.adapter_shards(), self.worker.device)

    def states(self) -> list[dict[str, Any]] | None:
        """Every rank's state, gathered on rank 0 (None on the others)."""
        return self._gather(self.worker.state_dict())

    def load_states(self, adapter: dict[str, torch.Tensor], states: list[dict[str, Any]] | None = None) -> None:
        """Rank 0 passes every rank's state and each rank receives only its own (a scatter)."""
        if self.world_size == 1:
            self.worker.load_state_dict(states[0], adapter)
            return
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, states if self.rank == 0 else None, src=0)
        self.worker.load_state_dict(mine[0], adapter)

    def _gather(self, mine: Any) -> list[Any] | None:
        """Every rank's `mine` on rank 0, in rank order (None on the others)."""
        if self.world_size == 1:
            return [mine]
        every: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        return every


class ColocatedRank(TrainerRank):
    """One rank of a colocated world: its trainer rank and its shard of one engine replica, on one device.

    The run's engines are world / `engine_tp` replicas of `engine_tp` consecutive ranks each (replica r: ranks
    [r * engine_tp, (r + 1) * engine_tp), its rank r * engine_tp the engine's leader). Every call runs on every
    rank (rank 0's result is the driver's). An engine call splits the samples by whole prompt groups over the
    replicas (`replica_share`), runs each share on its replica as one session of the engine's own protocol
    (its leader calls, its other ranks `follow()` until the leader `stop_followers()`), and gathers the
    outputs on rank 0 in the driver's order. Every sample keeps its own seed, so the samples drawn do not
    depend on the layout. `sync_adapter` moves the trainer's adapter blocks into the engine shards directly
    (`miles_k3.trainer.adapter_sync`): no rank gathers the whole adapter."""

    REPLAYED = TrainerRank.REPLAYED | frozenset(
        {
            "generate",
            "rollout",
            "release",
            "resume",
            "sync_adapter",
            "counters",
            "distill_drafter",
            "drafter_state",
            "load_drafter_state",
        }
    )

    def __init__(self, worker: TrainWorker, engine: RolloutWorker, rank: int, world_size: int, engine_tp: int = 1):
        super().__init__(worker, rank, world_size)
        self.engine, self.replicas = engine, world_size // engine_tp
        self.replica = rank // engine_tp
        self._sync: AdapterSync | None = None
        self._peaks: dict[str, int] = {}  # phase -> this rank's device bytes since the last sync reported them
        worker.park()  # the run starts with a rollout

    # ------------------------------------------------------------------ trainer
    # Memory phases: the trainer's parkable state (parallel.offload_optimizer / offload_base) is on the device
    # only inside the calls that read it; the engine's pools (and with rollout.offload_weights its weights) are
    # released by the driver around `train`.
    def train(self, batch: TrainBatch) -> dict[str, float] | None:
        self.worker.unpark()
        self._phase_start()
        metrics = self.worker.train(batch)
        self._phase_end("train")  # the trainer whole, the engine as the driver released it
        self.worker.park()
        return metrics

    def states(self) -> list[dict[str, Any]] | None:
        self.worker.unpark()
        try:
            return super().states()
        finally:
            self.worker.park()

    def load_states(self, adapter: dict[str, torch.Tensor], states: list[dict[str, Any]] | None = None) -> None:
        self.worker.unpark()
        try:
            super().load_states(adapter, states)
        finally:
            self.worker.park()

    def _phase_start(self) -> None:
        device = self.engine.engine.runner.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _phase_end(self, phase: str) -> None:
        """Note this rank's device memory at the end of a phase's work: CUDA, the allocator's peak since
        `_phase_start`; CPU, what the trainer's and the engine's tensors hold now (`resident_bytes`)."""
        device = self.engine.engine.runner.device
        if device.type == "cuda":
            now = torch.cuda.max_memory_allocated(device)
        else:
            now = self.worker.resident_bytes() + self.engine.resident_bytes()
        self._peaks[phase] = max(self._peaks.get(phase, 0), now)

    # ---------------------------------------------------------------- engine sessions
    def _session(self, call: Callable[[RolloutWorker], Any]) -> Any:
        """`call(worker)` on the replica's leader while its other ranks replay it; None on those."""
        engine = self.engine.engine
        if not engine.is_leader:
            engine.follow()
            return None
        try:
            return call(self.engine)
        finally:
            if engine.tp.size > 1:
                engine.stop_followers()

    def _shares(self, items: list, group_of: Callable[[Any], int], call) -> list | None:
        """`call(worker, indices)` on each replica for its share of `items`; rank 0: every item's result in
        order (the replicas' lists of their shares' results), None elsewhere."""
        mine = replica_share([group_of(x) for x in items], self.replicas, self.replica)
        out = self._session(lambda w: call(w, mine) if mine else [])
        every = self._gather(None if out is None else (mine, out))
        if every is None:
            return None
        result: list[Any] = [None] * len(items)
        for part in every:
            if part is not None:
                for i, x in zip(*part):
                    result[i] = x
        return result

    def generate(self, samples: list[Sample], params: list[SamplingParams]) -> list[Sample] | None:
        self._phase_start()
        out = self._shares(
            samples,
            lambda s: s.group_index,
            lambda w, idx: w.generate([samples[i] for i in idx], [params[i] for i in idx]),
        )
        self._phase_end("rollout")  # the engine whole, the trainer parked
        return out

    def rollout(self, fn: str, jobs: list[RolloutJob], tokenizer: tuple[str, str | None], client: str):
        self._phase_start()
        out = self._shares(
            jobs,
            lambda j: j.sample.group_index,
            lambda w, idx: w.rollout(fn, [jobs[i] for i in idx], tokenizer=tokenizer, client=client),
        )
        self._phase_end("rollout")
        return out

    def release(self) -> None:
        self._session(lambda w: w.release_memory())

    def resume(self) -> None:
        self._session(lambda w: w.resume_memory())

    def counters(self) -> dict[str, int] | None:
        every = self._gather(self._session(lambda w: w.engine_counters()))
        if every is None:
            return None
        leaders = [c for c in every if c is not None]
        return {k: sum(c[k] for c in leaders) for k in leaders[0]}

    # the drafter: every replica (one rank each: `resolve` refuses distillation of a sharded engine) distils the
    # same sequences from the same seed, so the replicas' drafters stay equal
    def distill_drafter(self, sequences, config, seed: int) -> dict[str, float]:
        return self.engine.distill_drafter(sequences, config, seed)

    def drafter_state(self) -> dict | None:
        return self.engine.drafter_state()

    def load_drafter_state(self, state: dict, config) -> None:
        self.engine.load_drafter_state(state, config)

    def sync_adapter(self) -> dict[str, float] | None:
        """The trainer's adapter into this rank's engine shard, block by block from the trainer ranks that own
        each (a collective of the world). Rank 0: the sync's milliseconds and the most bytes any rank sent /
        received."""
        start = time.perf_counter()
        held = self.worker.adapter_shards()
        pool = self.engine.engine.adapters
        if self._sync is None:
            self._sync = AdapterSync.build(held, pool.local_boxes(), pool.dtype, pool.device)
        blocks, sent, received = self._sync.run(held)
        self.engine.engine.set_adapter_shards(ADAPTER, blocks)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)
        peaks, self._peaks = self._peaks, {}
        every = self._gather(((time.perf_counter() - start) * 1e3, sent, received, peaks))
        if every is None:
            return None
        out = {
            "adapter_sync_ms": max(x[0] for x in every),
            "adapter_sync_sent_bytes_max": max(x[1] for x in every),
            "adapter_sync_received_bytes_max": max(x[2] for x in every),
        }
        # the step's device memory by phase, the fullest rank's (the phases since the last sync)
        for phase in sorted(set().union(*(x[3] for x in every))):
            out[f"memory_{phase}_bytes_max"] = max(x[3].get(phase, 0) for x in every)
        return out


def replica_share(groups: list[int], replicas: int, replica: int) -> list[int]:
    """The indices of the items `replica` of `replicas` takes: whole prompt groups (`groups`: each item's
    group), the distinct groups in order dealt into `replicas` contiguous runs as even as possible."""
    order = group_positions(groups)
    return [i for i, g in enumerate(groups) if order[g] * replicas // len(order) == replica]


def group_positions(groups: list[int]) -> dict[int, int]:
    """Each distinct prompt group's position among them, in first-seen order (how backends deal groups out)."""
    return {g: i for i, g in enumerate(dict.fromkeys(groups))}


class LocalRanks:
    """The driver's way to every rank of a local or external world: rank 0's target runs here, ranks
    1..N-1 replay its calls in `follow_ranks` until `stop`."""

    def __init__(self, target: ColocatedRank):
        self.target = target
        self.leader = rpc.Leader(rpc.Broadcast(0)) if target.world_size > 1 else None

    def call(self, name: str, *args) -> Any:
        """`name(*args)` on every rank; rank 0's result."""
        if self.leader is None:
            return rpc.dispatch(self.target, name, args)
        return self.leader.call(self.target, name, *args)

    def call_here(self, name: str, sent: tuple, extra: tuple) -> Any:
        """`name(*sent)` on the other ranks and `name(*sent, *extra)` here (what only rank 0 passes on, as a
        scatter inside the call)."""
        if self.leader is not None:
            self.leader.record(name, *sent)
            self.leader.flush()
        return rpc.dispatch(self.target, name, (*sent, *extra))

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()


def follow_ranks(target: ColocatedRank) -> None:
    """Ranks > 0 of a local or external world: run rank 0's calls until it stops the world."""
    rpc.follow(target, rpc.Broadcast(0))


class Ranks(Protocol):
    """How the driver reaches every rank: `LocalRanks` (a local or external world), `RayRanks` (actors)."""

    def call(self, name: str, *args) -> Any: ...
    def call_here(self, name: str, sent: tuple, extra: tuple) -> Any: ...
    def stop(self) -> None: ...


class ColocatedTrainers(TrainerGroup):
    """The trainer ranks of a colocated world (`Ranks`)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def train(self, batch):
        return self.ranks.call("train", batch)

    def adapter_parts(self):
        for i in range(self.ranks.call("adapter_part_count")):
            yield self.ranks.call("adapter_part", i)

    def states(self):
        return self.ranks.call("states")

    def load_states(self, states, adapter) -> None:
        # the others receive their own state from the scatter, not the message
        self.ranks.call_here("load_states", (adapter,), (states,))

    def shutdown(self) -> None:
        self.ranks.stop()


# ---------------------------------------------------------------------------------------------- engines
class ColocatedEngines(RolloutBackend):
    """The engine replicas of a colocated world, one shard on every trainer rank's device (`ColocatedRank`;
    rollout.tp ranks a replica). The trainer ranks are the same ranks, so the adapter sync is theirs to run:
    `sync_adapter` ignores the trainer group it is handed."""

    CAPABILITIES = frozenset({ROLLOUT_FN, DRAFTER})

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def generate(self, samples, params):
        return self.ranks.call("generate", samples, params)

    def release(self) -> None:
        self.ranks.call("release")

    def resume(self) -> None:
        self.ranks.call("resume")

    def sync_adapter(self, trainer: TrainerGroup) -> dict[str, float]:
        return self.ranks.call("sync_adapter")

    def counters(self) -> dict[str, int]:
        return self.ranks.call("counters")

    def drafter(self) -> Drafter:
        return _Calls(self.ranks)

    def plugins(self) -> Plugins:
        return _Calls(self.ranks)


class _Calls:
    """The drafter and plugin capabilities as calls on every rank."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def rollout(self, fn, jobs, *, tokenizer, client):
        return self.ranks.call("rollout", fn, jobs, tokenizer, client)

    def distill_drafter(self, sequences, config, seed):
        return self.ranks.call("distill_drafter", sequences, config, seed)

    def drafter_state(self):
        return self.ranks.call("drafter_state")

    def load_drafter_state(self, state, config) -> None:
        self.ranks.call("load_drafter_state", state, config)


# the rollout backends by rollout.backend, as "module:class" (imported when asked)
ROLLOUT_BACKENDS = {
    "colocated": "miles_k3.trainer.backends:ColocatedEngines",
    "http": "miles_k3.trainer.http_engines:HTTPEngines",
}


def backend_class(name: str) -> type[RolloutBackend]:
    """The rollout backend class of `rollout.backend` (its `CAPABILITIES` are what `resolve` checks)."""
    import importlib

    module, cls = ROLLOUT_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)
