"""Shared fixtures: a seeded k3-tiny reference, random adapters, the merged-weights oracle, and the set-up of
one rank of a spawned multi-process test world."""

from __future__ import annotations

import contextlib
import faulthandler
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_patches.parallel import end_world
from miles_k3.model import K3Config, K3ForCausalLM

CONFIG = K3Config.from_preset("k3-tiny")


def reference(config: K3Config = CONFIG, seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(config).eval()


def token_ids(batch: int = 2, length: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, CONFIG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def random_like(tensors: dict[str, torch.Tensor], seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * scale).to(v.dtype) for k, v in tensors.items()}


def merged_state(
    base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """The base HF state with each adapter folded in: W + scale * B @ A (per expert for stacked experts)."""
    state = {k: v.clone() for k, v in base.items()}
    for key, a in tensors.items():
        if not key.endswith(".lora_A"):
            continue
        module = key[: -len(".lora_A")]
        b = tensors[f"{module}.lora_B"]
        if a.dim() == 3:
            prefix, proj = module.rsplit(".", 1)
            for e in range(a.shape[0]):
                state[f"{prefix}.{e}.{proj}.weight"] += scale * b[e] @ a[e]
        else:
            state[f"{module}.weight"] += scale * b @ a
    return state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@contextlib.contextmanager
def spawned_rank(rank: int, world: int, port: int, watchdog_s: float, backend: str = "gloo") -> Iterator[None]:
    """One rank of a spawned test world: a watchdog (a rank stuck in a collective past `watchdog_s` prints every
    thread's stack and exits, so a hang fails the test instead of stalling CI), one intra-op thread (as the
    in-process references run), torch.distributed on 127.0.0.1:`port`, destroyed on exit."""
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        yield
    finally:
        end_world()


@contextlib.contextmanager
def layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> Iterator[None]:
    """megatron's parallel groups of that layout on the running world, torn down on exit."""
    from megatron_patches.parallel import destroy_parallel, init_parallel

    init_parallel(tp, pp, cp, ep)
    try:
        yield
    finally:
        destroy_parallel()


def spawn_world(worker, world: int, out, *args) -> list[dict]:
    """Run `worker(rank, world, port, out, *args)` on `world` spawned processes; each saves its results as
    `out/rank{r}.pt`, returned in rank order."""
    import torch.multiprocessing as mp

    from megatron_patches.parallel import free_port

    mp.spawn(worker, args=(world, free_port(), str(out), *args), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]
