"""Shared by the server tests: live servers (the embedded tiny K3 behind a real uvicorn on 127.0.0.1, a free
port, in a background thread of the test process, so a test can also reach the engine through its loop
thread), their in-process twins, and a PEFT adapter written by the trainer's own writer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from miles_k3.model.lora_spec import LoraSpec
from rollout.server.app import Server
from rollout.server.config import ServeConfig
from rollout.server.loading import Served, load_served

MODEL = "builtin:k3-tiny-arith"
ADAPTER = "policy"
# the engine settings every test server and its in-process twin share (quantize none: the stored base)
SETTINGS = dict(model=MODEL, quantize="none", port=0, max_seq_len=256, memory_mb=16.0)


def config(**overrides) -> ServeConfig:
    return ServeConfig(**{**SETTINGS, **overrides})


def serve(cfg: ServeConfig) -> Server:
    return Server(load_served(cfg), max_queued=cfg.max_queued, port=0).start()


def twin(cfg: ServeConfig) -> Served:
    """A second, in-process engine built from the same config: what the HTTP answers must equal."""
    return load_served(cfg)


def run_on_loop(server: Server, fn):
    """fn(engine) on the server's engine thread, from synchronous test code."""

    async def call():
        return await server.loop.call(fn)

    return asyncio.run(call())


def wait_idle(server: Server, timeout: float = 20.0) -> None:
    """Until the engine has no request (and the service none in flight)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.service.in_flight == 0 and not run_on_loop(server, lambda e: e.has_work()):
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy after {timeout} s ({server.service.in_flight} samples in flight)")


def write_adapter(path: Path, seed: int = 0, rank: int = 4, targets: tuple[str, ...] | None = None) -> Path:
    """A random PEFT adapter of `rank` (alpha 8) for the tiny model over `targets` (LoraSpec's; default: its
    default targets), written by the trainer's `save_peft`."""
    from miles_k3.model.assets import builtin_path
    from miles_k3.model.base import load_base
    from miles_k3.model.peft import save_peft
    from rollout.model_runner import build_engine_model

    spec = LoraSpec(rank=rank, alpha=8.0, **({} if targets is None else {"targets": targets}))
    cfg, state = load_base(builtin_path(MODEL))
    _, pool = build_engine_model(cfg, state, quantize="none", lora=spec, max_adapters=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in pool.A:
        tensors[f"{name}.lora_A"] = torch.randn(pool.A[name].shape[1:], generator=g) * 0.3
        tensors[f"{name}.lora_B"] = torch.randn(pool.B[name].shape[1:], generator=g) * 0.3
    save_peft(path, tensors, spec)
    return path
