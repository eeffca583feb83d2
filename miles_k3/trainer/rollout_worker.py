"""The engine side of the colocated loop: one rollout engine serving the frozen base plus the policy adapter.

Owns a `rollout.engine.Engine` built from the same base weights as the trainer (MXFP4 or BF16 base, per
`rollout.quantize`) with a one-slot adapter pool of the trainer's `LoraSpec`, holding the adapter "policy".
Safe to call from one thread. `rollout` runs a rollout plugin's samples (`miles_k3.trainer.rollout_plugin`)
against this engine: an engine loop thread drives it for the call's duration (in-process client), or
miles-serve's app over it on 127.0.0.1 (HTTP client); nothing else touches the engine meanwhile.

`generate` fills the driver's `Sample` records (`miles_k3.data.sample`). A sample with images brings them in its
`media` (`rollout.media.ImageFeatures`, computed once per prompt by the driver and shared by its samples): the
engine splices the features at the pads and keys its prefix cache by their content hash; it never encodes an
image here.

`ColocatedRank` (`miles_k3.trainer.backends`) calls it on each rank's engine shard.

With speculation (`EngineConfig.speculation`, from rollout.speculative), `engine_counters` adds the decode
strategy's `SpecStats` and `distill_drafter` distils the engine's drafter, in place, on sequences the loop
hands it, against the engine's own model with the policy adapter: the target the drafter is verified by.
"""

from __future__ import annotations

import asyncio
import random
import time

import torch

from miles_k3.data.sample import Sample
from miles_k3.data.tokenizers import load_tokenizer
from miles_k3.trainer.rollout_plugin import ADAPTER, EngineClient, HTTPClient, RolloutJob, load_rollout_fn, run_rollouts
from rollout.engine import Engine
from rollout.request import SamplingParams
from rollout.spec.distill import Blocks, DistillConfig, Distiller, Sequences, teacher_blocks
from rollout.spec.drafter import DSparkConfig, DSparkDrafter
from rollout.spec.strategy import SpecDecode

# SpecStats' counters, as engine_counters names them
SPEC_COUNTERS = {
    "spec_verify_steps": "steps",
    "spec_rows": "rows",
    "spec_drafted": "drafted",
    "spec_accepted": "accepted",
    "spec_emitted": "emitted",
}


class RolloutWorker:
    def __init__(self, engine: Engine, offload_weights: bool = False):
        """`engine`: built with one adapter slot of the trainer's LoraSpec (`rollout.build.build_engine` of
        `ResolvedConfig.engine_spec`). `offload_weights`: `release_memory` parks the engine's weights on the
        host too (rollout.offload_weights)."""
        self.engine, self.offload_weights = engine, offload_weights
        self._plugins: dict = {}  # rollout.fn reference -> RolloutFn, and the tokenizers it needs, built once
        self._distiller: Distiller | None = None  # the drafter's optimizer, built by the first distill_drafter

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

    def generate(self, samples: list[Sample], params: list[SamplingParams]) -> list[Sample]:
        """Each sample's completion, sampled with the policy adapter and its params, filled into the sample
        (`RolloutBackend.generate`); the samples, in order. A sample's images go to the engine with its ids (a
        text-only call is the plain one)."""
        ids = [s.prompt_ids for s in samples]
        if all(s.media is None for s in samples):
            outs = self.engine.generate(ids, params, adapter=ADAPTER)
        else:
            images = [None if s.media is None else list(s.media.images) for s in samples]
            outs = self.engine.generate(ids, params, adapter=ADAPTER, images=images)
        for s, o in zip(samples, outs):
            s.output_ids, s.logprobs = o.output_ids, o.logprobs or []
            s.loss_mask, s.finish_reason = [True] * len(o.output_ids), o.finish_reason.value
            s.routed_experts = o.routed_experts
        return samples

    def rollout(
        self, fn: str, jobs: list[RolloutJob], *, tokenizer: tuple[str, str | None], client: str = "engine"
    ) -> list[Sample]:
        """Each job's sample, filled by the rollout function `fn` ("module:function"), in job order, every
        sample's function running concurrently against this engine with the policy adapter. `tokenizer`:
        (model.tokenizer, model.path); `client`: "engine" (in-process) or "http" (miles-serve on loopback)."""
        if fn not in self._plugins:
            from rollout.server.tokenization import server_tokenizer

            kind, path = tokenizer
            codec = load_tokenizer(kind, path)  # loaded once: the server's tokenizer wraps it
            self._plugins[fn] = (load_rollout_fn(fn), codec, server_tokenizer(codec, path or "builtin"))
        plugin, codec, server_tok = self._plugins[fn]
        return asyncio.run(self._rollout(plugin, codec, server_tok, jobs, client, tokenizer[1]))

    async def _rollout(self, plugin, codec, server_tok, jobs, client, path) -> list[Sample]:
        vocab = self.engine.model.config.vocab_size
        if client == "http":
            import httpx

            from rollout.server.app import Server
            from rollout.server.loading import Served

            served = Served(self.engine, server_tok, "k3", (ADAPTER,), path or "builtin")
            server = Server(served, max_queued=1 << 20).start()
            routing = self.engine.runner.routing
            shape = None if routing is None else (routing.width, routing.top_k)
            try:
                async with httpx.AsyncClient(timeout=None) as http:
                    return await run_rollouts(
                        plugin, jobs, lambda job, loop: HTTPClient(job, codec, loop, http, server.url, shape), vocab
                    )
            finally:
                server.stop()
        from rollout.server.engine_loop import EngineLoop
        from rollout.server.generation import GenerationService

        loop = EngineLoop(self.engine)
        service = GenerationService(loop, server_tok, capacity=1 << 30)  # the engine queues what it cannot run
        loop.start()
        try:
            return await run_rollouts(plugin, jobs, lambda job, ev: EngineClient(job, codec, ev, service), vocab)
        finally:
            loop.stop(timeout=60)

    def engine_counters(self) -> dict[str, int]:
        """Since this worker was built: decode CUDA graphs captured and replayed, requests retracted, and
        with speculation the verify steps, rows verified, drafts verified, drafts kept and tokens emitted
        (`SPEC_COUNTERS`)."""
        counters = self.engine.counters()
        strategy = self.engine.decoder.strategy
        if isinstance(strategy, SpecDecode):
            counters.update({k: getattr(strategy.stats, f) for k, f in SPEC_COUNTERS.items()})
        return counters

    def policy_blocks(self, sequences: Sequences, examples: list[tuple[int, int]], config: DSparkConfig) -> Blocks:
        """`rollout.spec.distill.teacher_blocks` of the engine's model with the policy adapter: the blocks
        of `examples` ((sequence, anchor) pairs), their targets the policy's next-token distributions (what
        the engine samples from at temperature 1)."""
        runner = self.engine.runner
        slot = runner.adapters.slot_of(ADAPTER)

        def policy_batch(lengths: list[int]) -> None:  # every packed sequence through the policy's slot
            runner.adapters.set_batch([slot] * len(lengths), lengths)

        return teacher_blocks(runner.model, sequences, examples, config, before_forward=policy_batch)

    def _dspark(self) -> DSparkDrafter:
        strategy = self.engine.decoder.strategy
        if not isinstance(strategy, SpecDecode) or not isinstance(strategy.drafter, DSparkDrafter):
            raise ValueError(
                "distill_drafter needs an engine speculating with a DSpark drafter (rollout.speculative.drafter)"
            )
        return strategy.drafter

    def drafter_state(self) -> dict | None:
        """The distilled drafter's weights and its optimizer's state, for a checkpoint; None before the
        first distillation (the drafter is still the one loaded from rollout.speculative.drafter)."""
        if self._distiller is None:
            return None
        weights = {k: v.detach().cpu().clone() for k, v in self._dspark().state_dict().items()}
        return {"drafter": weights, "distiller": self._distiller.state_dict()}

    def load_drafter_state(self, state: dict, config: DistillConfig) -> None:
        """Continue from `drafter_state()`'s result (a resumed run): the weights copied into the engine's
        drafter in place, the optimizer rebuilt with `config` and its state restored."""
        drafter = self._dspark()
        drafter.load_state_dict(state["drafter"])  # copies into the existing tensors
        drafter.forget_contexts()
        self._distiller = Distiller(drafter, config)
        self._distiller.load_state_dict(state["distiller"])

    def distill_drafter(self, sequences: Sequences, config: DistillConfig, seed: int) -> dict[str, float]:
        """Distil the engine's drafter on `sequences` ((prompt length, prompt + response): the step's
        rollouts), the target being the engine's model with the policy adapter as it is now: `config.steps`
        optimizer steps (`rollout.spec.distill.Distiller.distil`, its optimizer kept across calls, `config`
        the same on every call), the drafter's tensors updated in place, so the engine's next step drafts
        with them. Between engine calls only. Returns drafter_tv_before / drafter_tv_after (held-out
        sequences of this batch), drafter_distill_loss, drafter_distill_blocks, drafter_distill_ms."""
        drafter = self._dspark()
        start = time.perf_counter()
        runner = self.engine.runner
        if self._distiller is None:
            self._distiller = Distiller(drafter, config)
        elif self._distiller.config != config:
            raise ValueError("distill_drafter: the DistillConfig changed between calls (the optimizer is built once)")
        out = self._distiller.distil(
            sequences, lambda examples: self.policy_blocks(sequences, examples, drafter.config), random.Random(seed)
        )
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return {
            "drafter_tv_before": out["tv_before"],
            "drafter_tv_after": out["tv_after"],
            "drafter_distill_loss": out["loss"],
            "drafter_distill_blocks": out["blocks"],
            "drafter_distill_ms": (time.perf_counter() - start) * 1e3,
        }

    def release_memory(self) -> None:
        self.engine.release_memory(weights=self.offload_weights)

    def resident_bytes(self) -> int:
        """Bytes this rank's engine holds now on its device (weights, adapter pool, KV and state pools)."""
        from miles_k3.offload import resident_bytes

        e, pool = self.engine, self.engine.adapters
        tensors = [*e.model.parameters(), *e.model.buffers()]
        if pool is not None:
            tensors += [*pool.A.values(), *pool.B.values()]
        return resident_bytes(tensors) + e.memory.resident_bytes()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def adapter_checksum(self) -> dict[str, float]:
        """Sum of every adapter tensor in the engine's slot (for the sync-equality check)."""
        pool = self.engine.adapters
        slot = pool.slot_of(ADAPTER)
        sums = {f"{m}.lora_A": float(a[slot].double().sum()) for m, a in pool.A.items()}
        sums.update({f"{m}.lora_B": float(b[slot].double().sum()) for m, b in pool.B.items()})
        return sums
