"""One rank's process and workers, as every launcher builds them: the process settings, its device, the
trainer rank (world, megatron's groups, the base, the policy) and the engine worker (`miles_k3.trainer.launch`
for the local and external launchers, `miles_k3.trainer.ray_launch`'s actors for Ray)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from miles_k3.model.base import TORCH_DTYPES
from miles_k3.trainer.base import load_base, quiet_megatron
from miles_k3.trainer.inputs import RunInputs
from miles_k3.trainer.resolve import ResolvedConfig
from miles_k3.trainer.rollout_worker import RolloutWorker
from miles_k3.trainer.train_worker import TrainWorker


def configure_process(rc: ResolvedConfig, rank: int = 0) -> None:
    """Threads, seeds, determinism and warning filters for one process (the same on every rank)."""
    quiet_megatron()
    if rc.cluster.threads_per_worker is not None:
        torch.set_num_threads(rc.cluster.threads_per_worker)
    torch.manual_seed(rc.trainer.seed + rank)
    if rc.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def device_for(rc: ResolvedConfig, local_rank: int) -> str:
    """The device of a worker: its local rank's GPU, or the only one it sees (`load_run_inputs` checked that
    the local launcher's exist; a Ray actor's is its bundle's GPU)."""
    if rc.cluster.device == "cuda":
        # one visible device: the launcher bound one GPU to this process (srun --gpus-per-task=1, Ray's bundle)
        index = 0 if torch.cuda.device_count() == 1 else local_rank
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


def build_rollout_worker(rc: ResolvedConfig, config, state, device: str) -> RolloutWorker:
    """This rank's engine worker over the base the trainer loaded (`config`, `state`), as `rc.engine_spec`
    says: with rollout.tp > 1 its shard of one of world / rollout.tp replicas (call it on every rank of the
    world at the same point: it creates every replica's process groups; the shard reads only its slices of
    a lazy `state`)."""
    from rollout.build import build_engine

    parallel = None
    if rc.rollout.tp > 1:
        from rollout.parallel import replica_groups

        r = rc.rollout
        parallel = replica_groups(r.tp, r.dcp, r.tp if r.ep else 1)
    engine = build_engine(rc.engine_spec(device), base=(config, state), parallel=parallel)
    return RolloutWorker(engine, offload_weights=rc.rollout.offload_weights)


def build_train_worker(rc: ResolvedConfig, config, state, device: str) -> TrainWorker:
    return TrainWorker(
        config,
        state,
        rc.lora,
        loss=rc.loss,
        algo=rc.algo,
        optim=rc.optim,
        temperature=rc.rollout.temperature,
        dtype=TORCH_DTYPES[rc.model.train_dtype],
        device=device,
        seed=rc.trainer.seed,
        sequence_parallel=rc.parallel.sp,
        pp_layers=rc.parallel.pp_layers,
        micro_batch_tokens=rc.parallel.micro_batch_tokens,
        recompute=rc.parallel.recompute,
        offload_optimizer=rc.parallel.offload_optimizer,
        offload_base=rc.parallel.offload_base,
    )


def start_trainer_rank(
    rc: ResolvedConfig,
    rank: int,
    device: str,
    init_method: str,
    inputs: RunInputs | None = None,
    *,
    whole: bool = False,
):
    """One trainer rank (local process or Ray actor; after `configure_process`): joins the torch.distributed
    world, builds megatron's groups for `parallel.*` over it, loads the base (or takes the checkpoint `inputs`
    already read) and the policy. `whole`: read the whole base (for an engine of one rank on the same
    process); else a checkpoint is a lazy source each side reads its own slices from. Returns (config, base
    state, worker); the caller drops the state once its engine shard (if it holds one) is built."""
    from megatron_patches.parallel import init_parallel

    backend = "nccl" if rc.cluster.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=rc.cluster.num_workers)
    par = rc.parallel
    init_parallel(par.tp, par.pp, par.cp, par.ep)
    if inputs is not None and inputs.base_state is not None:
        config, state = inputs.config, inputs.base_state
    else:
        config, state = load_base(rc.model, rc.trainer.seed, whole=whole)
    return config, state, build_train_worker(rc, config, state, device)
