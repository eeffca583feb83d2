"""EngineConfig: the rollout engine's settings, with their defaults and checks.

Built by the user (`Engine(model, EngineConfig(memory_bytes=64 << 20))`) or by the trainer's config from
the `rollout.*` keys; invalid values raise ValueError naming the field on construction.
"""

from __future__ import annotations

from dataclasses import dataclass


MXFP4_MATMULS = ("auto", "torch", "triton")
LORA_MIXED = ("torch", "triton")
OVERLAP_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    memory_bytes: int  # KV pages + KDA state slots, split by state_fraction
    state_fraction: float = 0.5
    page_size: int = 16
    chunk_size: int = 64  # KDA checkpoint granularity and prefill chunk alignment
    max_prefill_tokens: int = 512  # per step
    max_running: int = 64
    max_seq_len: int = 4096
    max_checkpoints_per_path: int = 4
    max_prefill_requests: int = 256  # requests packed into one prefill forward (short prompts: many fit the budget)
    cuda_graphs: bool = True  # decode from CUDA graphs on CUDA (batches whose rows share one adapter slot)
    # MXFP4 routed experts in bf16: "torch" decodes them to a bf16 copy per forward, then torch._grouped_mm;
    # "triton" runs rollout/kernels/mxfp4_moe.py, which decodes tiles in registers (CUDA only); "auto" takes
    # triton on CUDA (faster at every batch size measured on the H200, README "Rollout engine"), torch elsewhere
    mxfp4_matmul: str = "auto"
    # LoRA terms of batches whose rows use different adapters (multi-adapter serving; an RL rollout uses one):
    # "torch" runs one product per adapter present and reads the slots on the host; "triton" runs
    # rollout/kernels/lora_rows.py for every row at once from slot indices on the device (CUDA only; opt-in
    # until timed on the GPU)
    lora_mixed: str = "torch"
    # "auto": overlap consecutive decode steps on CUDA (module docstring); "on": also on CPU, where it only
    # reorders host work (the tests' way to run it); "off": every step waits for its tokens
    overlap: str = "auto"
    # torch.compile the CUDA-graph decode step (rollout.forward.DecodeGraphs); CUDA graphs only, opt-in
    compile_decode: bool = False

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        if self.mxfp4_matmul not in MXFP4_MATMULS:
            raise ValueError(f"mxfp4_matmul must be one of {MXFP4_MATMULS}, got {self.mxfp4_matmul!r}")
        if self.lora_mixed not in LORA_MIXED:
            raise ValueError(f"lora_mixed must be one of {LORA_MIXED}, got {self.lora_mixed!r}")
        if self.chunk_size % self.page_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be a multiple of page_size ({self.page_size})")
        if self.max_prefill_tokens < self.chunk_size or self.max_prefill_tokens % self.chunk_size:
            raise ValueError(f"max_prefill_tokens ({self.max_prefill_tokens}) must be a positive multiple of "
                             f"chunk_size ({self.chunk_size})")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_prefill_requests < 1:
            raise ValueError(f"max_prefill_requests must be >= 1, got {self.max_prefill_requests}")
