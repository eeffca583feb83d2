"""K3 on megatron-core (trainer side): the shared K3 definition (`miles_k3.model`) built on megatron's
tensor-parallel linears through its factories, with trainable LoRA adapters and PEFT I/O.

    from megatron_patches import build_policy, lora_parameters, adapter_state, adapters_disabled
    policy = build_policy(config, base_state, LoraSpec(rank=8), dtype=torch.bfloat16, device="cuda")

Modules, one job each:
    parallel.py   megatron parallel state on a torch.distributed world; MegatronTP (this rank's share
                  and its collectives, handed to the shared layers); single-process TP=1 helpers
    linears.py    column / row / replicated linears and TP-split routed experts, frozen base + LoRA
    lora.py       LoraWeights (one adapter, TP-aware) and the model-level API: lora_parameters,
                  adapter_state / load_adapter_state (engine naming), adapters_disabled, gradient
                  helpers (adapter_grads, average_lora_grads_, clip_lora_grad_norm_)
    model.py      build_policy: build on meta, shard the full HF state per rank, fresh adapters
    peft_io.py    save_peft / load_peft: PEFT adapter directories with HF K3 module names
"""

from miles_k3.model.lora_spec import DEFAULT_TARGETS, LoraSpec
from megatron_patches.lora import (adapter_grads, adapter_state, adapters_disabled, average_lora_grads_,
                                   clip_lora_grad_norm_, load_adapter_state, lora_parameters)
from megatron_patches.model import build_policy, reference_state
from megatron_patches.parallel import destroy_parallel, ensure_parallel, init_parallel, single_process
from megatron_patches.peft_io import load_peft, save_peft

__all__ = [
    "DEFAULT_TARGETS", "LoraSpec", "build_policy", "reference_state", "lora_parameters", "adapter_state",
    "load_adapter_state", "adapters_disabled", "adapter_grads", "average_lora_grads_", "clip_lora_grad_norm_",
    "init_parallel", "destroy_parallel", "ensure_parallel", "single_process", "save_peft", "load_peft",
]
