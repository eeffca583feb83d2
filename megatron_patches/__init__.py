"""K3 on megatron-core (trainer side): the shared K3 definition (`miles_k3.model`) built on megatron's
parallel linears through its factories, with trainable LoRA adapters and PEFT I/O, for every layout
(TP / SP, PP, CP, EP, DP).

    from megatron_patches import build_policy, init_parallel, lora_parameters, adapter_state
    init_parallel(tp_size, pp_size, cp_size, ep_size)      # on a torch.distributed world
    policy = build_policy(config, base_state, LoraSpec(rank=8), dtype=torch.bfloat16, device="cuda")

Modules, one job each:
    parallel.py          megatron parallel state on a torch.distributed world; MegatronTP (this rank's share
                         and its collectives, handed to the shared layers); single-process TP=1 helpers
    linears.py           column / row / replicated linears and the routed experts (TP- or EP-split), frozen
                         base + LoRA
    lora.py              LoraWeights (one adapter) and the model-level API: lora_parameters, adapter_state /
                         load_adapter_state (engine naming, gathered over TP / EP / PP), adapters_disabled,
                         reduce_lora_grads_ (replicas summed), check_lora_replicas, clip_lora_grad_norm_
    model.py             build_policy: build this rank's shard on meta, read its slices, fresh adapters
    loading.py           local_state: a rank's slices read from a lazy checkpoint source
    pipeline.py          stage layer splits, the AttnRes-packed residual across stages, gathers over stages
    schedule.py          forward / backward over micro-batches through megatron's schedules (1F1B)
    cpu_device.py        megatron's CUDA device choices redirected on CPU (gloo runs)
    context_parallel.py  the zigzag split and the mixers' CP share (KDA relayout, MLA latent gather)
    expert_parallel.py   the routed experts' EP share and the dropless all-to-all dispatch
    vocab_parallel.py    the vocab-parallel embedding / lm_head and token log-probs without [M, V] logits
    layout_plan.py       the layout planner's per-rank byte counts (meta builds in a fake world)
"""

from megatron_patches.lora import (
    adapter_grads,
    adapter_state,
    adapters_disabled,
    check_lora_replicas,
    clip_lora_grad_norm_,
    load_adapter_state,
    lora_parameters,
    reduce_lora_grads_,
)
from megatron_patches.model import build_policy, reference_state
from megatron_patches.parallel import destroy_parallel, ensure_parallel, init_parallel, single_process
from miles_k3.model.lora_spec import DEFAULT_TARGETS, LoraSpec

__all__ = [
    "DEFAULT_TARGETS",
    "LoraSpec",
    "build_policy",
    "reference_state",
    "lora_parameters",
    "adapter_state",
    "load_adapter_state",
    "adapters_disabled",
    "adapter_grads",
    "check_lora_replicas",
    "reduce_lora_grads_",
    "clip_lora_grad_norm_",
    "init_parallel",
    "destroy_parallel",
    "ensure_parallel",
    "single_process",
]
