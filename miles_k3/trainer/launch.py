"""Launchers: build the workers for a resolved config and run the driver.

local, cluster.num_workers == 1: one process; the engine and the trainer share it (and its device) (with
    rollout.exact on CPU, a spawned one that starts with `exact.CPU_ENV` unless this one did).
local, num_workers == N > 1: N processes on this machine (torch.multiprocessing, gloo on CPU / nccl on
    GPU), one trainer rank each, in the layout of `parallel.*`, and one shard of an engine replica each (N /
    rollout.tp replicas of rollout.tp ranks, `miles_k3.trainer.backends.ColocatedRank`); rank 0 also runs the
    driver. The other ranks replay the driver's calls by name (`miles_k3.trainer.backends.follow_ranks`).
external: this process is one rank of a world that srun (one task per GPU, over any number of nodes) or
    torchrun started; its rank and rank 0's address come from the environment (`ClusterCfg.rendezvous`).
    Rank 0 runs the driver, as above. scripts/slurm/train_multinode.sbatch starts it.
ray: see `miles_k3.trainer.ray_launch` (a placement group, one rank actor per bundle).

Each launcher hands the driver one rollout backend and one trainer group (`miles_k3.trainer.backends`).

Every process watches for preemption signals (`miles_k3.trainer.preempt`); when the driver stopped on one,
`launch` raises `Preempted` once every rank has ended (in the external world: on rank 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from miles_k3.ops import exact
from miles_k3.rewards import RewardPluginError
from miles_k3.trainer import preempt
from miles_k3.trainer.backends import (
    ColocatedEngines,
    ColocatedRank,
    ColocatedTrainers,
    LocalRanks,
    TrainerRank,
    follow_ranks,
)
from miles_k3.trainer.inputs import RunInputs, load_run_inputs
from miles_k3.trainer.loop import GRPODriver
from miles_k3.trainer.resolve import ResolvedConfig
from miles_k3.trainer.workers import build_rollout_worker, configure_process, device_for, start_trainer_rank

log = logging.getLogger(__name__)


def _rank_main(
    rank: int,
    rc: ResolvedConfig,
    run_dir: str,
    init_method: str,
    inputs: RunInputs | None = None,
    outcome=None,
    local_rank: int | None = None,
) -> None:
    """One rank: its trainer rank and its engine shard (`ColocatedRank`); rank 0 also the driver. `outcome`: in
    a spawned world, a queue that carries how rank 0's run ended (a RewardPluginError's message, or a
    preemption) back to the launching process; None: raised here. `local_rank`: the rank's device index on
    its node (default: `rank`)."""
    with preempt.watch(), exact.numerics(rc.rollout.exact):
        configure_process(rc, rank)
        device = device_for(rc, rank if local_rank is None else local_rank)
        try:
            world, colocated = rc.cluster.num_workers, rc.rollout.backend == "colocated"
            config, state, trainer = start_trainer_rank(
                rc, rank, device, init_method, inputs, whole=colocated and rc.rollout.tp == 1
            )
            # with rollout.backend=http the engines are servers elsewhere: the ranks are trainers only
            engine = build_rollout_worker(rc, config, state, device) if colocated else None
            # trainer and engine hold their own copies; the fp32 base need not live through the run (cleared,
            # not just unnamed: `inputs` holds it too)
            if isinstance(state, dict):
                state.clear()
            del state
            if colocated:
                target = ColocatedRank(trainer, engine, rank, world, rc.rollout.tp)
            else:
                target = TrainerRank(trainer, rank, world)
            if rank == 0:
                try:
                    driver = _drive(rc, run_dir, LocalRanks(target), inputs)
                except RewardPluginError as e:
                    if outcome is None:
                        raise
                    outcome.put(("reward", str(e)))  # every rank ends normally (told to stop); the launcher raises
                else:
                    if driver.preempted is not None:
                        if outcome is None:
                            raise preempt.Preempted(driver.preempted, driver.step)
                        outcome.put(("preempted", (driver.preempted, driver.step)))
            else:
                follow_ranks(target)
        finally:
            from megatron_patches.parallel import destroy_parallel, end_world

            destroy_parallel()
            end_world()


def _drive(rc: ResolvedConfig, run_dir: str, ranks: LocalRanks, inputs: RunInputs | None) -> GRPODriver:
    trainers = ColocatedTrainers(ranks)
    fleet = None
    try:
        if rc.rollout.backend == "colocated":
            engines = ColocatedEngines(ranks)
        elif rc.cluster.mode == "disaggregated":  # engine servers of the run's own, restarted when one dies
            from miles_k3.trainer.engine_fleet import EngineFleet

            fleet = EngineFleet(rc, run_dir)
            engines = http_engines(rc, inputs, fleet.start(), fleet.restart)
        else:
            engines = http_engines(rc, inputs, rc.rollout.urls)
        driver = GRPODriver(rc, run_dir, engines, trainers, inputs)
        try:
            driver.run()
        finally:
            engines.shutdown()
    finally:
        try:
            if fleet is not None:  # first: nothing the trainers' shutdown raises may leave a server running
                fleet.stop()
        finally:
            trainers.shutdown()
    return driver


def http_engines(rc: ResolvedConfig, inputs: RunInputs | None, urls: list[str], revive=None):
    """The servers at `urls` as the run's rollout backend (`miles_k3.trainer.http_engines`); `revive(url)` starts
    one again (cluster.mode=disaggregated)."""
    from miles_k3.model.lora_spec import adapter_family
    from miles_k3.trainer.base import load_base_config
    from miles_k3.trainer.http_engines import HTTPEngines

    config = inputs.config if inputs is not None else load_base_config(rc.model)
    r = rc.rollout
    return HTTPEngines(
        urls,
        rc.lora,
        config,
        adapter_family(config),
        record_routing=r.record_routing,
        keep_versions=r.max_staleness + 1,
        partial=r.partial,
        adapter_dir=r.adapter_dir,
        revive=revive,
    )


def exact_cpu_env(rc: ResolvedConfig) -> dict[str, str]:
    """The environment rollout.exact's ranks must start with on CPU and this process lacks (`exact.CPU_ENV`;
    empty: none needed)."""
    if not rc.rollout.exact or rc.cluster.device != "cpu" or not exact.cpu_env_missing():
        return {}
    return dict(exact.CPU_ENV)


@contextlib.contextmanager
def environ(env: dict[str, str]):
    """os.environ with `env` while the block runs (what spawned processes inherit)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(rc: ResolvedConfig, run_dir: str | Path, inputs: RunInputs | None = None) -> None:
    """Run the whole job (blocking). `inputs`: what `load_run_inputs(rc, run_dir)` returned, if the caller
    read them first (to report a bad input before anything starts); read here otherwise. Spawned ranks
    read their own (rank 0 without the checkpoint's tensors, which every rank loads itself). Raises
    `preempt.Preempted` (a SystemExit with PREEMPTED_EXIT) when a signal stopped the run early."""
    run_dir = str(run_dir)
    inputs = inputs or load_run_inputs(rc, run_dir)
    if rc.cluster.launcher == "ray":
        from miles_k3.trainer.ray_launch import launch_ray

        launch_ray(rc, run_dir, inputs._replace(base_state=None))
        return
    if rc.cluster.launcher == "external":
        world = rc.cluster.rendezvous()  # ClusterCfg.check matched its world size to num_workers
        # rank 0 keeps what the caller read (the driver's inputs); the others read only their own slices
        _rank_main(
            world.rank, rc, run_dir, world.init_method, inputs if world.rank == 0 else None, local_rank=world.local_rank
        )
        return
    from miles_k3.ranks import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    # rollout.exact on CPU: ranks in processes that start with exact.CPU_ENV (this one may have loaded torch
    # without it), a one-rank world too
    fresh = exact_cpu_env(rc)
    if rc.cluster.num_workers == 1 and not fresh:
        _rank_main(0, rc, run_dir, init_method, inputs)
        return
    # how rank 0's run ended, raised here as itself (a reward plugin failing is the user's mistake, not a
    # child's traceback; a preemption is this process's exit status)
    outcome = torch.multiprocessing.get_context("spawn").SimpleQueue()
    with preempt.watch(), environ(fresh):  # Slurm signals this process too: it waits for the ranks' checkpoint
        torch.multiprocessing.spawn(
            _rank_main, args=(rc, run_dir, init_method, None, outcome), nprocs=rc.cluster.num_workers, join=True
        )
    if not outcome.empty():
        kind, detail = outcome.get()
        if kind == "reward":
            raise RewardPluginError(detail)
        raise preempt.Preempted(*detail)
