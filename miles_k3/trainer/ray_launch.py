"""The Ray launcher: a placement group with one bundle per worker (one GPU each with cluster.device=cuda), and in
each bundle one rank actor holding that rank's trainer rank and its shard of an engine replica
(`miles_k3.trainer.backends.ColocatedRank`, as the local launcher's processes do): bundle i is rank i, and an
engine replica is rollout.tp consecutive bundles.

The actors form one torch.distributed world (gloo on CPU, nccl on GPU; rank 0's node address and a free port,
found by rank 0's actor), megatron's groups for parallel.* and the engine replicas' groups over it. The driver
(this process) runs `GRPODriver` with `ColocatedEngines` and `ColocatedTrainers` over `RayRanks`: every call
goes to every actor by name (`miles_k3.rpc.dispatch`), and the collectives inside it (the update's, the
shard-to-shard adapter sync, the gathers of samples on rank 0) meet across the actors.

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
from miles_k3.trainer.backends import ColocatedEngines, ColocatedRank, ColocatedTrainers
from miles_k3.trainer.inputs import RunInputs
from miles_k3.trainer.loop import GRPODriver
from miles_k3.trainer.resolve import ResolvedConfig


class _RankActor:
    """One bundle's rank: its trainer rank and its engine shard (`ColocatedRank`), on the bundle's device."""

    def __init__(self, rc: ResolvedConfig, rank: int):
        self.rc, self.rank = rc, rank

    def address(self) -> tuple[str, int]:
        import ray

        from megatron_patches.parallel import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master: tuple[str, int]) -> None:
        from miles_k3.ops import exact

        with exact.numerics(self.rc.rollout.exact):  # the builds too (an actor's calls may come on other threads)
            self._setup(master)

    def _setup(self, master: tuple[str, int]) -> None:
        from miles_k3.trainer.workers import build_rollout_worker, configure_process, device_for, start_trainer_rank

        rc = self.rc
        configure_process(rc, self.rank)
        device = device_for(rc, 0)  # Ray exposes the bundle's GPU as cuda:0
        init = f"tcp://{master[0]}:{master[1]}"
        config, state, trainer = start_trainer_rank(rc, self.rank, device, init, whole=rc.rollout.tp == 1)
        engine = build_rollout_worker(rc, config, state, device)
        del state
        self.target = ColocatedRank(trainer, engine, self.rank, rc.cluster.num_workers, rc.rollout.tp)

    def call(self, name: str, *args) -> Any:
        from miles_k3.ops import exact

        with exact.numerics(self.rc.rollout.exact):  # an actor's calls may come on other threads
            return rpc.dispatch(self.target, name, args)


class RayRanks:
    """The driver's way to every rank under Ray: each call goes to every actor (the arguments put in the object
    store once) and returns rank 0's result."""

    def __init__(self, actors: list):
        self.actors = actors

    def call(self, name: str, *args) -> Any:
        import ray

        refs = [ray.put(a) for a in args]
        return ray.get([actor.call.remote(name, *refs) for actor in self.actors])[0]

    def call_here(self, name: str, sent: tuple, extra: tuple) -> Any:
        """`name(*sent, *extra)` on rank 0's actor, `name(*sent)` on the others."""
        import ray

        refs = [ray.put(a) for a in sent]
        calls = [a.call.remote(name, *refs, *(extra if i == 0 else ())) for i, a in enumerate(self.actors)]
        return ray.get(calls)[0]

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


def start_ray_workers(rc: ResolvedConfig) -> tuple[RayRanks, Any]:
    """Placement group + one rank actor per bundle (the caller owns ray.init / ray.shutdown); returns (ranks,
    placement group)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = rc.cluster.device == "cuda"
    bundle = {"CPU": 1, **({"GPU": 1} if gpu else {})}
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
    threads = rc.cluster.threads_per_worker or 1
    env = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    if rc.rollout.exact and not gpu:  # the actors' processes start with rollout.exact's CPU environment
        from miles_k3.ops.exact import CPU_ENV

        env["env_vars"].update(CPU_ENV)

    def placed(i: int):  # bundle i is rank i: engine replicas are runs of consecutive bundles
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        return (
            ray.remote(_RankActor)
            .options(scheduling_strategy=strategy, runtime_env=env, num_cpus=1, num_gpus=1 if gpu else 0)
            .remote(rc, i)
        )

    actors = [placed(i) for i in range(rc.cluster.num_workers)]
    master = ray.get(actors[0].address.remote())
    ray.get([a.setup.remote(master) for a in actors])
    return RayRanks(actors), pg


def launch_ray(rc: ResolvedConfig, run_dir: str | Path, inputs: RunInputs | None = None) -> None:
    import ray

    own = not ray.is_initialized()
    if own:
        # no cluster.ray_address means a local instance of our own: address=None would join whatever cluster
        # /tmp/ray/ray_current_cluster names, a dead one included (where it waits for good)
        ray.init(address=rc.cluster.ray_address or "local", include_dashboard=False, log_to_driver=True)
    with preempt.watch():
        try:
            ranks, pg = start_ray_workers(rc)
            try:
                driver = GRPODriver(rc, run_dir, ColocatedEngines(ranks), ColocatedTrainers(ranks), inputs)
                driver.run()
            finally:
                ranks.stop()
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
