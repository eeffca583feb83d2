"""EngineConfig: the rollout engine's settings, with their defaults and checks.

Built by the user (`Engine(model, EngineConfig(memory_bytes=64 << 20))`) or by the trainer's config from
the `rollout.*` keys (whose defaults are these). Invalid values raise ValueError on construction, the
message starting with `EngineConfig.<field>`. Rules that need the model (its device, its pool sizes) are
checked where the engine meets the model.
"""

from __future__ import annotations

from dataclasses import dataclass

MXFP4_MATMULS = ("auto", "torch", "triton")
LORA_MIXED = ("torch", "triton")
MLA_ATTENTIONS = ("auto", "torch", "triton")
OVERLAP_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's memory budget and scheduling limits. Checked on construction: ValueError starting with
    `EngineConfig.<field>`."""

    memory_bytes: int  # KV pages + KDA state slots, split by state_fraction
    # share of memory_bytes for KDA state slots, the rest for KV pages (two pools; unified_memory ignores it)
    state_fraction: float = 0.5
    page_size: int = 16  # tokens per KV page
    chunk_size: int = 64  # KDA checkpoint granularity and prefill chunk alignment (a multiple of page_size)
    max_prefill_tokens: int = 512  # prompt tokens prefilled per step (a multiple of chunk_size)
    max_running: int = 64  # requests decoding at once; further ones wait
    max_seq_len: int = 4096  # prompt + generated tokens of one request
    max_checkpoints_per_path: int = 4  # KDA state checkpoints kept per root-to-leaf path of the prefix cache
    max_prefill_requests: int = 256  # requests packed into one prefill forward (short prompts: many fit the budget)
    cuda_graphs: bool = True  # decode from CUDA graphs on CUDA (batches whose rows share one adapter slot)
    # MXFP4 routed experts in bf16: "torch" decodes them to a bf16 copy per forward, then torch._grouped_mm;
    # "triton" runs rollout/kernels/expert_gemm.py, which decodes tiles in registers (CUDA only); "auto" takes
    # triton on CUDA (faster at every batch size measured on the H200, docs/benchmarks.md), torch elsewhere
    mxfp4_matmul: str = "auto"
    # LoRA terms of batches whose rows use different adapters (multi-adapter serving; an RL rollout uses one):
    # "torch" runs one product per adapter present and reads the slots on the host; "triton" runs
    # rollout/kernels/lora_rows.py for every row at once from slot indices on the device (CUDA only; opt-in
    # until timed on the GPU)
    lora_mixed: str = "torch"
    # MLA attention over the KV pages: "torch" gathers each request's history and attends in torch; "triton"
    # runs rollout/kernels/mla_attention.py, which reads the pages in place (CUDA; the CPU tests run it through
    # the interpreter); "auto" takes triton on CUDA with kernels on (2x-7x faster than torch per layer at every
    # batch and history measured on the H200, docs/benchmarks.md), torch elsewhere
    mla_attention: str = "auto"
    # "auto": overlap consecutive decode steps on CUDA (rollout.decode's docstring); "on": also on CPU, where
    # it only reorders host work (the tests' way to run it); "off": every step waits for its tokens
    overlap: str = "auto"
    # torch.compile the CUDA-graph decode step (rollout.forward.DecodeGraphs); CUDA graphs only, opt-in
    compile_decode: bool = False
    # KDA state slots and MLA KV pages carved from one byte pool that grows from both ends, so capacity
    # follows the workload instead of `state_fraction`'s split (rollout/cache_manager.py); off until measured
    unified_memory: bool = False
    # decode context parallelism inside the tensor-parallel group: MLA's latent KV sharded by token position
    # over `dcp_size` ranks (rank r keeps positions p with p % dcp_size == r); 1: every rank keeps all of it
    dcp_size: int = 1
    # record each token's routed experts per MoE layer (`Completion.routed_experts`, for the trainer's routing
    # replay): a table beside the KV pages, so prefix hits and speculation keep the routing that computed the
    # KV; decode runs eagerly while it is on (the table's writes are not in the CUDA graphs yet)
    record_routing: bool = False
    # speculative decoding (rollout.engine.strategy_for builds the decode strategy from it); None: one token
    # per row per step
    speculation: object | None = None

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"EngineConfig.{name} {rule}, got {getattr(self, name)!r}")

        for name in (
            "memory_bytes",
            "page_size",
            "chunk_size",
            "max_prefill_tokens",
            "max_running",
            "max_seq_len",
            "max_checkpoints_per_path",
            "max_prefill_requests",
            "dcp_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, "must be an integer >= 1")
        if not 0.0 < self.state_fraction < 1.0:
            raise fail("state_fraction", "must lie in (0, 1)")
        for name, options in (
            ("mxfp4_matmul", MXFP4_MATMULS),
            ("lora_mixed", LORA_MIXED),
            ("mla_attention", MLA_ATTENTIONS),
            ("overlap", OVERLAP_MODES),
        ):
            if getattr(self, name) not in options:
                raise fail(name, f"must be one of {options}")
        for name in ("cuda_graphs", "compile_decode", "unified_memory", "record_routing"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "must be a bool")
        if self.chunk_size % self.page_size:
            raise fail("chunk_size", f"must be a multiple of page_size ({self.page_size})")
        if self.max_prefill_tokens % self.chunk_size:
            raise fail("max_prefill_tokens", f"must be a multiple of chunk_size ({self.chunk_size})")
        if self.record_routing and self.unified_memory:
            raise fail(
                "record_routing",
                "needs unified_memory=False (the routing table follows KV page ids, which unified memory moves)",
            )
        if self.page_size % self.dcp_size:
            raise fail(
                "dcp_size",
                f"must divide page_size ({self.page_size}): each rank keeps page_size / dcp_size rows of a page",
            )
