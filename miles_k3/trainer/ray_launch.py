"""The Ray launcher: a placement group with one bundle per worker; each bundle holds a trainer actor and an
engine actor, colocated (same node, same GPU when cluster.device=cuda, each taking half of it).

The trainer actors form one torch.distributed world (gloo on CPU, nccl on GPU; rank 0's node address and a
free port, found by rank 0's actor) and megatron's TP group over it. Every engine actor generates a
contiguous share of each rollout batch. The driver (this process) runs `GRPODriver` with `RayEngines` and
`RayTrainers` (`miles_k3.trainer.backends`); an actor takes the driver's calls by name (`miles_k3.rpc.dispatch`
on its `RolloutWorker` or `TrainerRank`). Adapter tensors travel trainer rank 0 -> object store -> every engine
(one `ray.put`).

The placement group packs its bundles onto as few nodes as hold them (PACK), so a run larger than one node
spans several: scripts/slurm/train_multinode.sbatch starts a Ray head and a worker per Slurm node, waits for
every node (`python -m miles_k3.trainer.ray_launch wait ADDRESS NODES`), then runs the driver with
cluster.ray_address. A placement group the cluster cannot hold within cluster.ray_placement_timeout_s is
a ValueError naming the resources. The driver watches for preemption signals like the local launcher's
(`miles_k3.trainer.preempt`; the batch file forwards its own to it) and `launch_ray` raises `Preempted`
after the actors are gone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from miles_k3 import rpc
from miles_k3.trainer import preempt
from miles_k3.trainer.backends import RolloutBackend, TrainerGroup, TrainerRank
from miles_k3.trainer.inputs import RunInputs
from miles_k3.trainer.loop import GRPODriver
from miles_k3.trainer.resolve import ResolvedConfig


class _TrainerActor:
    def __init__(self, rc: ResolvedConfig, rank: int):
        self.rc, self.rank = rc, rank

    def address(self) -> tuple[str, int]:
        import ray

        from megatron_patches.parallel import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master: tuple[str, int]) -> None:
        from miles_k3.trainer.workers import configure_process, device_for, start_trainer_rank

        configure_process(self.rc, self.rank)
        # Ray exposes the bundle's GPU as cuda:0
        _, _, worker = start_trainer_rank(self.rc, self.rank, device_for(self.rc, 0), f"tcp://{master[0]}:{master[1]}")
        self.target = TrainerRank(worker, self.rank, self.rc.cluster.num_workers)

    def call(self, name: str, *args) -> Any:
        return rpc.dispatch(self.target, name, args)


class _EngineActor:
    def __init__(self, rc: ResolvedConfig):
        from miles_k3.trainer.base import load_base
        from miles_k3.trainer.workers import build_rollout_worker, configure_process, device_for

        configure_process(rc)
        config, state = load_base(rc.model, rc.trainer.seed)
        self.target = build_rollout_worker(rc, config, state, device_for(rc, 0))

    def call(self, name: str, *args) -> Any:
        return rpc.dispatch(self.target, name, args)


def _on_all(actors: list, name: str, *args) -> list[Any]:
    import ray

    return ray.get([a.call.remote(name, *args) for a in actors])


class RayEngines(RolloutBackend):
    """An engine actor per bundle; each generates a contiguous share of every batch."""

    def __init__(self, actors: list):
        self.actors = actors

    def generate(self, samples, params):
        import ray

        k = len(self.actors)
        bounds = [len(samples) * i // k for i in range(k + 1)]
        shares = [
            e.call.remote("generate", samples[lo:hi], params[lo:hi])
            for e, lo, hi in zip(self.actors, bounds, bounds[1:])
            if hi > lo
        ]
        return [s for share in ray.get(shares) for s in share]  # the actors' filled copies, in order

    def counters(self) -> dict[str, int]:
        per_engine = _on_all(self.actors, "engine_counters")
        return {key: sum(c[key] for c in per_engine) for key in per_engine[0]}

    def release(self) -> None:
        _on_all(self.actors, "release_memory")

    def resume(self) -> None:
        _on_all(self.actors, "resume_memory")

    def sync_adapter(self, trainer: TrainerGroup) -> dict[str, float]:
        import ray

        tensors = ray.put(trainer.adapter_state())
        return {"adapter_sync_ms": max(_on_all(self.actors, "sync_adapter", tensors))}

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


class RayTrainers(TrainerGroup):
    """A trainer actor per bundle, one torch.distributed world; every call goes to every actor."""

    def __init__(self, actors: list):
        self.actors = actors

    def train(self, batch):
        return _on_all(self.actors, "train", batch)[0]

    def adapter_state(self):
        return _on_all(self.actors, "adapter_state")[0]

    def states(self):
        return _on_all(self.actors, "states")[0]

    def load_states(self, states, adapter) -> None:
        import ray

        ray.get([t.call.remote("load_states", adapter, states if i == 0 else None) for i, t in enumerate(self.actors)])

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


def start_ray_workers(rc: ResolvedConfig) -> tuple[RayEngines, RayTrainers, Any]:
    """Placement group + actors (the caller owns ray.init / ray.shutdown); returns (engines, trainers, placement
    group)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = rc.cluster.device == "cuda"
    bundle = {"CPU": 2, **({"GPU": 1} if gpu else {})}
    pg = placement_group([dict(bundle) for _ in range(rc.cluster.num_workers)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=rc.cluster.ray_placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise ValueError(
            f"cluster.num_workers: {rc.cluster.num_workers} bundles of {bundle} not placed within "
            f"cluster.ray_placement_timeout_s ({rc.cluster.ray_placement_timeout_s} s); the Ray "
            f"cluster holds {ray.cluster_resources()}"
        ) from None
    share = {"num_cpus": 1, "num_gpus": 0.5 if gpu else 0}
    threads = rc.cluster.threads_per_worker or 1
    env = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}

    def placed(cls, i: int, *args):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        return ray.remote(cls).options(scheduling_strategy=strategy, runtime_env=env, **share).remote(*args)

    trainers = [placed(_TrainerActor, i, rc, i) for i in range(rc.cluster.num_workers)]
    engines = [placed(_EngineActor, i, rc) for i in range(rc.cluster.num_workers)]
    master = ray.get(trainers[0].address.remote())
    ray.get([t.setup.remote(master) for t in trainers])
    return RayEngines(engines), RayTrainers(trainers), pg


def launch_ray(rc: ResolvedConfig, run_dir: str | Path, inputs: RunInputs | None = None) -> None:
    import ray

    own = not ray.is_initialized()
    if own:
        # no cluster.ray_address means a local instance of our own: address=None would join whatever cluster
        # /tmp/ray/ray_current_cluster names, a dead one included (where it waits for good)
        ray.init(address=rc.cluster.ray_address or "local", include_dashboard=False, log_to_driver=True)
    with preempt.watch():
        try:
            engines, trainers, pg = start_ray_workers(rc)
            try:
                driver = GRPODriver(rc, run_dir, engines, trainers, inputs)
                driver.run()
            finally:
                trainers.shutdown()
                engines.shutdown()
                ray.util.remove_placement_group(pg)
        finally:
            if own:
                ray.shutdown()
    if driver.preempted is not None:
        raise preempt.Preempted(driver.preempted, driver.step)


def wait_for_nodes(address: str, nodes: int, timeout_s: float) -> int:
    """Block until the Ray cluster at `address` has `nodes` live nodes (the batch file's workers joining);
    returns how many it has. TimeoutError after `timeout_s`."""
    import ray

    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while (alive := sum(n["Alive"] for n in ray.nodes())) < nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray cluster at {address} has {alive} of {nodes} nodes after {timeout_s} s")
            time.sleep(1.0)
        return alive
    finally:
        ray.shutdown()


if __name__ == "__main__":  # python -m miles_k3.trainer.ray_launch wait ADDRESS NODES [TIMEOUT_S]
    if len(sys.argv) not in (4, 5) or sys.argv[1] != "wait":
        sys.exit("usage: python -m miles_k3.trainer.ray_launch wait ADDRESS NODES [TIMEOUT_S]")
    timeout = float(sys.argv[4]) if len(sys.argv) == 5 else 600.0
    print(f"ray cluster: {wait_for_nodes(sys.argv[2], int(sys.argv[3]), timeout)} nodes up")
