"""The engine side of the colocated loop: one rollout engine serving the frozen base plus the policy adapter.

Owns a `rollout.engine.Engine` built from the same base weights as the trainer (MXFP4 or BF16 base, per
`rollout.quantize`) with a one-slot adapter pool of the trainer's `LoraSpec`, holding the adapter "policy".
Safe to call from one thread.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from miles_k3.model.config import K3Config
from miles_k3.model.lora_spec import LoraSpec
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.model_runner import build_engine_model
from rollout.request import SamplingParams

ADAPTER = "policy"


class Generated(NamedTuple):
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class RolloutWorker:
    def __init__(self, config: K3Config, base_state: dict[str, torch.Tensor], lora: LoraSpec, *, quantize: str,
                 dtype: torch.dtype, device: str, engine: EngineConfig):
        model, pool = build_engine_model(config, base_state, quantize=quantize, lora=lora, max_adapters=1,
                                         dtype=dtype, device=device)
        self.engine = Engine(model, engine, pool)

    def sync_adapter(self, tensors: dict[str, torch.Tensor]) -> float:
        """Copy the trainer's adapter into the engine's slot in place; returns the milliseconds it took
        (dtype/device conversion included). The first call loads the adapter into a free slot."""
        start = time.perf_counter()
        pool = self.engine.adapters
        converted = {k: v.to(device=pool.device, dtype=pool.dtype) for k, v in tensors.items()}
        if ADAPTER in pool.names:
            self.engine.update_adapter(ADAPTER, converted)
        else:
            self.engine.add_adapter(ADAPTER, converted)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)
        return (time.perf_counter() - start) * 1e3

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generated]:
        """Completions in prompt order, sampled with the policy adapter."""
        outs = self.engine.generate(prompts, params, adapter=ADAPTER)
        return [Generated(o.output_ids, o.logprobs or [], o.finish_reason.value) for o in outs]

    def engine_counters(self) -> dict[str, int]:
        """Since this worker was built: decode CUDA graphs captured and replayed, requests retracted."""
        return self.engine.counters()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def adapter_checksum(self) -> dict[str, float]:
        """Sum of every adapter tensor in the engine's slot (for the sync-equality check)."""
        pool = self.engine.adapters
        slot = pool.slot_of(ADAPTER)
        sums = {f"{m}.lora_A": float(a[slot].double().sum()) for m, a in pool.A.items()}
        sums.update({f"{m}.lora_B": float(b[slot].double().sum()) for m, b in pool.B.items()})
        return sums
