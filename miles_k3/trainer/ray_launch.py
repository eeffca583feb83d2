"""The Ray launcher: a placement group with one bundle per worker; each bundle holds a trainer actor and an
engine actor, colocated (same node, same GPU when cluster.device=cuda, each taking half of it).

The trainer actors form one torch.distributed world (gloo on CPU, nccl on GPU; rank 0's node address and a
free port, found by rank 0's actor) and megatron's TP group over it. Every engine actor generates a
contiguous share of each rollout batch. The driver (this process) runs `GRPODriver` with `RayWorkers`;
adapter tensors travel trainer rank 0 -> object store -> every engine (one `ray.put`).

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

from miles_k3.trainer import preempt
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
        from miles_k3.trainer.launch import configure_process, device_for, start_trainer_rank

        configure_process(self.rc, self.rank)
        # Ray exposes the bundle's GPU as cuda:0
        _, _, self.worker = start_trainer_rank(self.rc, self.rank, device_for(self.rc, 0),
                                               f"tcp://{master[0]}:{master[1]}")

    def call(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)


class _EngineActor:
    def __init__(self, rc: ResolvedConfig):
        from miles_k3.trainer.base import load_base
        from miles_k3.trainer.launch import build_rollout_worker, configure_process, device_for

        configure_process(rc)
        config, state = load_base(rc.model, rc.trainer.seed)
        self.worker = build_rollout_worker(rc, config, state, device_for(rc, 0))

    def call(self, method: str, *args) -> Any:
        return getattr(self.worker, method)(*args)


class RayWorkers:
    def __init__(self, trainers: list, engines: list):
        self.trainers, self.engines = trainers, engines

    def _all_trainers(self, method: str, *args) -> list[Any]:
        import ray

        return ray.get([t.call.remote(method, *args) for t in self.trainers])

    def generate(self, prompts, params):
        import ray

        k = len(self.engines)
        bounds = [len(prompts) * i // k for i in range(k + 1)]
        shares = [e.call.remote("generate", prompts[lo:hi], params[lo:hi])
                  for e, lo, hi in zip(self.engines, bounds, bounds[1:]) if hi > lo]
        return [g for share in ray.get(shares) for g in share]

    def engine_counters(self) -> dict[str, int]:
        import ray

        per_engine = ray.get([e.call.remote("engine_counters") for e in self.engines])
        return {key: sum(c[key] for c in per_engine) for key in per_engine[0]}

    def release_engines(self) -> None:
        import ray

        ray.get([e.call.remote("release_memory") for e in self.engines])

    def resume_engines(self) -> None:
        import ray

        ray.get([e.call.remote("resume_memory") for e in self.engines])

    def train(self, batch):
        return self._all_trainers("train", batch)[0]

    def adapter_state(self):
        return self._all_trainers("adapter_state")[0]

    def sync_adapter(self, tensors) -> float:
        import ray

        ref = ray.put(tensors)
        return max(ray.get([e.call.remote("sync_adapter", ref) for e in self.engines]))

    def trainer_states(self):
        return self._all_trainers("state_dict")

    def load_trainer_states(self, states, adapter) -> None:
        import ray

        ray.get([t.call.remote("load_state_dict", s, adapter) for t, s in zip(self.trainers, states)])

    def shutdown(self) -> None:
        import ray

        for actor in (*self.trainers, *self.engines):
            ray.kill(actor)


def start_ray_workers(rc: ResolvedConfig) -> tuple[RayWorkers, Any]:
    """Placement group + actors (the caller owns ray.init / ray.shutdown); returns (workers, placement group)."""
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
        raise ValueError(f"cluster.num_workers: {rc.cluster.num_workers} bundles of {bundle} not placed within "
                         f"cluster.ray_placement_timeout_s ({rc.cluster.ray_placement_timeout_s} s); the Ray "
                         f"cluster holds {ray.cluster_resources()}") from None
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
    return RayWorkers(trainers, engines), pg


def launch_ray(rc: ResolvedConfig, run_dir: str | Path, inputs: RunInputs | None = None) -> None:
    import ray

    own = not ray.is_initialized()
    if own:
        # no cluster.ray_address means a local instance of our own: address=None would join whatever cluster
        # /tmp/ray/ray_current_cluster names, a dead one included (where it waits for good)
        ray.init(address=rc.cluster.ray_address or "local", include_dashboard=False, log_to_driver=True)
    with preempt.watch():
        try:
            workers, pg = start_ray_workers(rc)
            try:
                driver = GRPODriver(rc, run_dir, workers, inputs)
                driver.run()
            finally:
                workers.shutdown()
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
