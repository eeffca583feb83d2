"""build_policy: the trainer's K3 — the shared definition on megatron linears, frozen base, LoRA on top.

    policy = build_policy(config, base_state, LoraSpec(rank=8), dtype=torch.bfloat16, device="cuda")
    logits = policy(input_ids).logits          # [B, T, V], full vocab on every TP rank
    opt = torch.optim.AdamW(lora_parameters(policy))
    with adapters_disabled(policy): ref_logits = policy(input_ids).logits   # the KL reference

The model is `miles_k3.model.K3ForCausalLM` itself (same forward, packed `cu_seqlens`, decode cache),
built with this package's factories and a `MegatronTP` share. Every TP rank of a group calls
`build_policy` with the same arguments and the same full `base_state`; each keeps its slices.

Pipeline parallelism: each rank builds only its stage's decoder layers (`megatron_patches.pipeline`:
megatron's PP rank and the `pp_layers` split), loads only those tensors, and runs through
`megatron_patches.schedule`; the factories are unchanged.

Placement of the other parallelisms (not built yet), so they add to this without rewrites:
- CP: the KDA / MLA mixers receive `cu_seqlens`-style context to hand fla's `chunk_kda(cp_context=)`
  and an all-gather of the MLA latent KV; linears and adapters see only local tokens and need no change.
- EP: `ParallelExperts` splits the expert dim instead of (or besides) the intermediate dim, with an
  all-to-all token dispatch in `RoutedExperts.forward`; adapters stay per expert ([E, r, in] slices),
  gathered along E for export.
"""

from __future__ import annotations

import re

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from miles_k3.model.checkpoint import stored_dtype
from miles_k3.model.config import K3Config
from miles_k3.model.layout import tensor_shapes
from miles_k3.model.linear import ExpertsSpec, LinearSpec
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.modeling import K3ForCausalLM, reference_state
from megatron_patches.context_parallel import context_share
from megatron_patches.linears import ColumnLinear, ParallelExperts, ReplicatedLinear, RowLinear
from megatron_patches.lora import lora_modules, lora_parameters
from megatron_patches.parallel import MegatronTP, ensure_parallel
from megatron_patches.pipeline import this_stage

# Per-head tensors of a KDA mixer that follow its heads across TP ranks (dim 0 of the full tensor).
_KDA_HEAD_SPLIT = re.compile(r"\.self_attn\.([qkv]_conv1d\.weight|dt_bias)$")
_EXPERT_SPLIT = re.compile(r"\.experts\.\d+\.(w[13]|w2)\.weight$")


class PolicyFactory:
    """The LinearFactory / ExpertsFactory of one build; remembers each linear's split for loading."""

    def __init__(self, config: ModelParallelConfig, tp: MegatronTP, lora: LoraSpec | None):
        self.config, self.tp, self.lora = config, tp, lora
        self.split_dim: dict[str, int | None] = {}  # "<module>.weight" -> split dim of the full weight

    def linear(self, spec: LinearSpec) -> nn.Module:
        self.split_dim[f"{spec.name}.weight"] = {"column": 0, "row": 1, "replicated": None}[spec.parallel]
        if spec.parallel == "column":
            return ColumnLinear(spec, self.config, self.tp, self.lora, gather=spec.name == "lm_head")
        if spec.parallel == "row":
            return RowLinear(spec, self.config, self.tp, self.lora)
        return ReplicatedLinear(spec, self.config, self.tp, self.lora)

    def experts(self, spec: ExpertsSpec) -> nn.Module:
        return ParallelExperts(spec, self.config, self.tp, self.lora)


def _check_tp(config: K3Config, tp: MegatronTP) -> None:
    """Every dim that a column / row split divides must divide by the TP size (ValueError names it)."""
    checks = {"kda_num_heads": config.kda_num_heads, "mla_num_heads": config.mla_num_heads}
    if config.first_dense_layers > 0:
        checks["dense_intermediate_size"] = config.dense_intermediate_size
    if not config.tie_word_embeddings:
        checks["vocab_size"] = config.vocab_size
    if any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        checks["moe_intermediate_size"] = config.moe_intermediate_size
        if config.num_shared_experts > 0:
            checks["shared experts (moe_intermediate_size * num_shared_experts)"] = config.shared_intermediate
    for field, n in checks.items():
        tp.split(n, field)


def _local_tensor(name: str, full: torch.Tensor, factory: PolicyFactory, config: K3Config) -> torch.Tensor:
    """This rank's slice of the full HF tensor `name`."""
    tp = factory.tp
    if tp.size == 1:
        return full
    if name in factory.split_dim:
        dim = factory.split_dim[name]
        return full if dim is None else tp.shard(full, dim)
    if _KDA_HEAD_SPLIT.search(name):
        return tp.shard(full, 0)
    if name.endswith(".self_attn.A_log"):
        # checkpoint forms: [1, 1, H, 1] or [H zero-padded]; the rank keeps its heads' rates
        return tp.shard(full.reshape(-1)[:config.kda_num_heads], 0)
    m = _EXPERT_SPLIT.search(name)
    if m:
        return tp.shard(full, 0 if m.group(1) in ("w1", "w3") else 1)
    return full  # replicated: embeddings, norms, AttnRes queries, router


def build_policy(config: K3Config, base_state: dict[str, torch.Tensor] | None, lora: LoraSpec, *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, sequence_parallel: bool = False,
                 pp_layers: list[int] | None = None) -> K3ForCausalLM:
    """The trainer's model for this rank.

    base_state: the logical HF state dict, full tensors, no wrapper prefix (as
        `miles_k3.model.checkpoint.load_state_dict` returns); None = the reference init for `seed`.
        Tensors are sliced for this rank and cast to `dtype` (router / decay tensors stay fp32, as the
        checkpoint loader keeps them). The caller keeps ownership; the model holds copies or views.
    lora: which modules get adapters. Adapters are created in `dtype`, A seeded by (seed, module name),
        B zero, so the fresh policy computes exactly the base model.
    Megatron's parallel state is used as found (TP size from it); with no torch.distributed world, a
    single-process TP=1 world is started (see `megatron_patches.parallel.ensure_parallel`).
    sequence_parallel: shard the residual stream along the sequence over the TP group (needs TP > 1; see
        `miles_k3.model.linear`). Logits and hidden states still come back whole on every rank.
    device "meta": this rank's shapes only, for the layout planner (base_state must be None; nothing is read or
        drawn, the adapters are trainable meta parameters).
    pp_layers: decoder layers per pipeline stage (None = even; see `megatron_patches.pipeline.stage_layers`);
        this rank builds the stage of its megatron PP rank. With PP = 1 it is the whole model.

    Returns a K3ForCausalLM whose only trainable parameters are the adapters (`lora_parameters`),
    in train mode; `policy.tp` is its TP share, `policy.lora_spec` the spec and `policy.lora_generator` the
    generator of the adapters' dropout masks (seeded by `seed`, identical on every TP rank);
    `policy.model.layer_range` its stage's layers and `policy.residual_dtype` (= dtype) the dtype of the
    residual state its pipeline sends carry.
    """
    if not isinstance(lora, LoraSpec):
        raise ValueError(f"lora must be a LoraSpec, got {type(lora).__name__}")
    ensure_parallel()
    tp, cp = MegatronTP(sequence_parallel), context_share()
    _check_tp(config, tp)
    layers = this_stage(config.num_hidden_layers, pp_layers)
    mp = ModelParallelConfig(tensor_model_parallel_size=tp.size, params_dtype=dtype,
                             use_cpu_initialization=True, perform_initialization=False)
    factory = PolicyFactory(mp, tp, lora)
    with torch.device("meta"):
        model = K3ForCausalLM(config, linear=factory.linear, experts=factory.experts, tp=tp, cp=cp, layers=layers)

    if torch.device(device).type == "meta":  # shapes only (the layout planner): nothing read, nothing drawn
        if base_state is not None:
            raise ValueError("build_policy on the meta device takes no base_state")
        model.requires_grad_(False)
        for p in lora_parameters(model):
            p.requires_grad_(True)
        model.tp, model.lora_spec, model.lora_generator = tp, lora, None
        model.residual_dtype = dtype
        return model.train()
    full = base_state if base_state is not None else reference_state(config, seed)
    expected = tensor_shapes(config)
    missing = sorted(set(expected) - set(full))
    unknown = sorted(set(full) - set(expected))
    if missing or unknown:
        raise ValueError(f"base_state does not match the config: missing {missing[:4]}, unknown {unknown[:4]}")
    for name, shape in expected.items():
        if tuple(full[name].shape) != shape:
            raise ValueError(f"base_state[{name!r}]: shape {tuple(full[name].shape)}, expected {shape}")

    # The local model names the tensors this rank holds (a pipeline stage's layers, an expert-parallel
    # rank's experts); `_local_tensor` cuts the tensor-parallel slice of each.
    local_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    local = {}
    for name in expected:
        if name not in local_shapes:
            continue
        t = _local_tensor(name, full[name], factory, config)
        assert tuple(t.shape) == local_shapes[name], f"{name}: local {tuple(t.shape)} vs {local_shapes[name]}"
        local[name] = t.to(device=device, dtype=stored_dtype(name, dtype), copy=True)
    result = model.load_state_dict(local, strict=False, assign=True)
    left = [k for k in result.missing_keys if not _is_adapter_or_extra(k)]
    assert not left and not result.unexpected_keys, (left, result.unexpected_keys)

    model.requires_grad_(False)
    generator = torch.Generator(device=device).manual_seed(seed)
    for m in lora_modules(model):
        m.reset(seed, dtype, device)
        m.generator = generator
    # `lora_generator` draws the LoRA dropout masks: save / restore its state for a bit-exact resume
    model.tp, model.lora_spec, model.lora_generator = tp, lora, generator
    model.residual_dtype = dtype
    return model.train()


def _is_adapter_or_extra(key: str) -> bool:
    return key.endswith("_extra_state") or ".lora." in key
