"""build_policy: the trainer's K3 — the shared definition on megatron linears, frozen base, LoRA on top.

    policy = build_policy(config, CheckpointSource(path, config), LoraSpec(rank=8), dtype=torch.bfloat16,
                          device="cuda", pp_layers=None)
    opt = torch.optim.AdamW(lora_parameters(policy))
    # forward / backward through megatron_patches.schedule (every layout); log-probs through
    # megatron_patches.vocab_parallel.token_logprobs (the logits are this TP rank's vocab slice)

The model is `miles_k3.model.K3ForCausalLM` itself (same forward, packed `cu_seqlens`, decode cache), built
with this package's factories and this rank's shares of every parallelism, all read from megatron's parallel
state (`megatron_patches.parallel.init_parallel`):
- TP (`MegatronTP`): column / row linears, per-head KDA / MLA tensors, the routed experts' intermediate dim,
  and the vocabulary of the embedding and lm_head (`megatron_patches.vocab_parallel`).
- PP (`megatron_patches.pipeline`): only this stage's decoder layers are built and loaded.
- CP (`megatron_patches.context_parallel`): the mixers' share of each zigzag-split row.
- EP (`megatron_patches.expert_parallel`): `ParallelExperts` holds num_experts / ep experts.
Each rank reads only the tensors (and slices) it holds from the base's source.

Images: the first stage's `K3Model` takes each micro-batch's image features (`MediaEmbeds` at the packed row's
media pad positions, spliced into the embeddings before the SP scatter) from `policy.media_feed`: the trainer
names, for one schedule call, which packed row carries which features (`MediaFeed.feeding`), and the feed hands
them to the forward that gets that row (megatron's schedule calls the stage with the row only).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

import torch
from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from megatron_patches.context_parallel import MegatronCP, context_share
from megatron_patches.expert_parallel import ExpertParallel
from megatron_patches.linears import ColumnLinear, ParallelExperts, ReplicatedLinear, RowLinear
from megatron_patches.loading import local_state
from megatron_patches.lora import lora_modules, lora_parameters
from megatron_patches.parallel import MegatronTP, ensure_parallel
from megatron_patches.pipeline import stage_layers, this_stage
from megatron_patches.vocab_parallel import VocabParallelEmbedding
from miles_k3.model.checkpoint import StateDictSource, TensorSource, stored_dtype
from miles_k3.model.config import K3Config
from miles_k3.model.layout import tensor_shapes
from miles_k3.model.linear import ExpertsSpec, LinearSpec, TensorParallel
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.modeling import K3ForCausalLM, reference_state
from miles_k3.model.routing import Routing

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
            return ColumnLinear(spec, self.config, self.tp, self.lora)  # lm_head: this rank's vocab slice
        if spec.parallel == "row":
            return RowLinear(spec, self.config, self.tp, self.lora)
        return ReplicatedLinear(spec, self.config, self.tp, self.lora)

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        self.split_dim["model.embed_tokens.weight"] = 0  # vocab-parallel: this rank's rows
        return VocabParallelEmbedding(num_embeddings, dim, self.config)

    def experts(self, spec: ExpertsSpec) -> nn.Module:
        return ParallelExperts(spec, self.config, self.tp, self.lora)


class MediaFeed:
    """The image features of the micro-batches of one schedule call, by packed row: a forward pre-hook on the
    first stage's `K3Model` that adds `media=` to the call whose `input_ids` is a row named in `feeding` (the
    same tensor object the schedule passes on). Outside `feeding` it adds nothing (text-only forwards, the
    engine's model are untouched); inside it, a row it was not told of is a bug and raises.

    Safe to use from the one thread that runs the schedule; `feeding` does not nest."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[torch.Tensor, object]] | None = None  # id(input_ids) -> (input_ids, media)

    @contextlib.contextmanager
    def feeding(self, rows: list[tuple[torch.Tensor, object]]):
        """For the calls inside: each (input_ids [1, N], MediaEmbeds or None) pair's row gets its media."""
        if self._rows is not None:
            raise RuntimeError("MediaFeed.feeding does not nest")
        self._rows = {id(ids): (ids, media) for ids, media in rows}
        try:
            yield
        finally:
            self._rows = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._rows is None or kwargs.get("media") is not None:
            return None
        ids = args[0] if args else kwargs["input_ids"]
        found = self._rows.get(id(ids))
        if found is None or found[0] is not ids:
            raise RuntimeError(
                "MediaFeed: a forward of a packed row not named in feeding() (under context "
                "parallelism the stage gets a shard: image prompts need cp=1)"
            )
        return (args, kwargs) if found[1] is None else (args, {**kwargs, "media": found[1]})


def check_layout(
    config: K3Config, tp: TensorParallel, ep_size: int = 1, pp_size: int = 1, pp_layers: list[int] | None = None
) -> None:
    """That `config` splits over the layout, before anything is built (ValueError naming the field): every dim a
    column / row split divides by the TP size, the routed experts by the EP size, the layers into `pp_size`
    stages (`pp_layers`)."""
    stage_layers(config.num_hidden_layers, pp_size, pp_layers)
    ExpertParallel(ep_size).split(config.num_experts)
    checks = {
        "kda_num_heads": config.kda_num_heads,
        "mla_num_heads": config.mla_num_heads,
        "vocab_size": config.vocab_size,
    }
    if config.first_dense_layers > 0:
        checks["dense_intermediate_size"] = config.dense_intermediate_size
    if any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        checks["moe_intermediate_size"] = config.moe_intermediate_size
        if config.num_shared_experts > 0:
            checks["shared experts (moe_intermediate_size * num_shared_experts)"] = config.shared_intermediate
    for field, n in checks.items():
        tp.split(n, field)


def _local_tensor(name: str, source: TensorSource, factory: PolicyFactory, config: K3Config) -> torch.Tensor:
    """This rank's slice of the full HF tensor `name`, read from `source` (only that slice is read)."""
    tp = factory.tp
    if tp.size == 1:
        return source.read(name)

    def shard(dim: int) -> torch.Tensor:
        step = source.shapes[name][dim] // tp.size
        return source.narrow(name, dim, tp.rank * step, step)

    if name in factory.split_dim:
        dim = factory.split_dim[name]
        return source.read(name) if dim is None else shard(dim)
    if _KDA_HEAD_SPLIT.search(name):
        return shard(0)
    if name.endswith(".self_attn.A_log"):
        # checkpoint forms: [1, 1, H, 1] or [H zero-padded]; the rank keeps its heads' rates
        step = config.kda_num_heads // tp.size
        return source.a_log_heads(name, tp.rank * step, step)
    m = _EXPERT_SPLIT.search(name)
    if m:
        return shard(0 if m.group(1) in ("w1", "w3") else 1)
    return source.read(name)  # replicated: norms, AttnRes queries, router


def build_policy(
    config: K3Config,
    base_state: dict[str, torch.Tensor] | TensorSource | None,
    lora: LoraSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    sequence_parallel: bool = False,
    pp_layers: list[int] | None = None,
    recompute: bool = False,
) -> K3ForCausalLM:
    """The trainer's model for this rank.

    base_state: a `miles_k3.model.checkpoint.CheckpointSource` (each rank reads only its own slices from the
        safetensors files), or the logical HF state dict (full tensors, no wrapper prefix, as `load_state_dict`
        returns); None = the reference init for `seed`. Tensors are sliced for this rank and cast to `dtype`
        (router / decay tensors stay fp32, as the checkpoint loader keeps them). The caller keeps ownership.
    lora: which modules get adapters. Adapters are created in `dtype`, A seeded by (seed, module name),
        B zero, so the fresh policy computes exactly the base model.
    Megatron's parallel state is used as found (TP size from it); with no torch.distributed world, a
    single-process TP=1 world is started (see `megatron_patches.parallel.ensure_parallel`).
    sequence_parallel: shard the residual stream along the sequence over the TP group (needs TP > 1; see
        `miles_k3.model.linear`). Hidden states still come back whole on every rank.
    Under TP the embedding and lm_head are vocab-parallel: `policy.logits(h)` is this rank's vocab slice
    (`megatron_patches.vocab_parallel.token_logprobs` reduces over it; `policy.tp.gather_last_dim` gathers it).
    device "meta": this rank's shapes only, for the layout planner (base_state must be None; nothing is read or
        drawn, the adapters are trainable meta parameters).
    pp_layers: decoder layers per pipeline stage (None = even; see `megatron_patches.pipeline.stage_layers`);
        this rank builds the stage of its megatron PP rank. With PP = 1 it is the whole model.
    recompute: recompute each decoder layer's activations in backward (activation checkpointing,
        `recompute_layers`): the same gradients for the memory of the layers' inputs.

    Returns a K3ForCausalLM whose only trainable parameters are the adapters (`lora_parameters`),
    in train mode; `policy.tp` is its TP share, `policy.lora_spec` the spec and `policy.lora_generator` the
    generator of the adapters' dropout masks (seeded by `seed`, identical on every TP rank);
    `policy.model.layer_range` its stage's layers and `policy.residual_dtype` (= dtype) the dtype of the
    residual state its pipeline sends carry; `policy.media_feed` (first stage; None on later ones) the
    `MediaFeed` that hands image features to the micro-batches' forwards.
    """
    if not isinstance(lora, LoraSpec):
        raise ValueError(f"lora must be a LoraSpec, got {type(lora).__name__}")
    ensure_parallel()
    tp, cp = MegatronTP(sequence_parallel), context_share()
    check_layout(
        config, tp, ps.get_expert_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(), pp_layers
    )
    layers = this_stage(config.num_hidden_layers, pp_layers)
    mp = ModelParallelConfig(
        tensor_model_parallel_size=tp.size,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    factory = PolicyFactory(mp, tp, lora)
    with torch.device("meta"):
        model = K3ForCausalLM(
            config,
            linear=factory.linear,
            experts=factory.experts,
            tp=tp,
            cp=cp,
            layers=layers,
            embedding=factory.embedding,
        )

    if torch.device(device).type == "meta":  # shapes only (the layout planner): nothing read, nothing drawn
        if base_state is not None:
            raise ValueError("build_policy on the meta device takes no base_state")
        # held as the real build holds them: base tensors in their stored dtype, adapters in `dtype`
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(dtype if ".lora." in name else stored_dtype(name, dtype))
        model.requires_grad_(False)
        for p in lora_parameters(model):
            p.requires_grad_(True)
        model.tp, model.lora_spec, model.lora_generator = tp, lora, None
        model.residual_dtype = dtype
        _install_media_feed(model)
        if recompute:
            recompute_layers(model)
        return model.train()
    if base_state is None:
        base_state = reference_state(config, seed)
    source = StateDictSource(base_state, config, dtype) if isinstance(base_state, Mapping) else base_state
    expected = tensor_shapes(config)
    missing = sorted(set(expected) - set(source.shapes))
    unknown = sorted(set(source.shapes) - set(expected))
    if missing or unknown:
        raise ValueError(f"base_state does not match the config: missing {missing[:4]}, unknown {unknown[:4]}")
    for name, shape in expected.items():
        if tuple(source.shapes[name]) != shape:
            raise ValueError(f"base_state[{name!r}]: shape {tuple(source.shapes[name])}, expected {shape}")

    # The local model names the tensors this rank holds (a pipeline stage's layers, an expert-parallel
    # rank's experts); `_local_tensor` reads the tensor-parallel slice of each, and only that, from the source.
    local_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    local = local_state(
        source,
        [n for n in expected if n in local_shapes],
        lambda name, src: _local_tensor(name, src, factory, config),
        dtype=dtype,
        device=device,
    )
    for name, t in local.items():
        assert tuple(t.shape) == local_shapes[name], f"{name}: local {tuple(t.shape)} vs {local_shapes[name]}"
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
    _install_media_feed(model)
    model.routing = Routing(model, config)  # routing replay (`MicroBatch.routing`); inert until a table comes
    if recompute:
        recompute_layers(model)
    return model.train()


def _install_media_feed(model: K3ForCausalLM) -> None:
    """`model.media_feed`: a `MediaFeed` on the stage's K3Model when it holds the embedding (first stage),
    else None (a later stage takes no media)."""
    model.media_feed = MediaFeed() if model.model.first else None
    if model.media_feed is not None:
        model.model.register_forward_pre_hook(model.media_feed, with_kwargs=True)


def recompute_layers(model: K3ForCausalLM) -> None:
    """Wrap each decoder layer of `model` in torch's non-reentrant activation checkpoint: its forward keeps only
    its inputs (the residual state), and its backward runs the layer's forward again to rebuild what it needs.

    The recomputed forward is the same computation: torch restores the global (and CUDA) RNG; the wrapper
    also replays the LoRA dropout generator (`model.lora_generator`: set to its state at this layer's forward,
    put back after, so the masks match and later draws are unchanged) and, under context parallelism, the
    row's layout (the backward runs outside `cp.sharded`). Collectives inside a layer (TP / SP / EP / CP)
    run again in the backward, in the same order on every rank of their group. `state_dict()` and the
    adapters' (engine) names are unchanged; module paths (`named_parameters()` of the policy) gain the
    wrapper's `_checkpoint_wrapped_module.`, and attribute reads pass through it (`layers[0].self_attn`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    generator, cp, routing = model.lora_generator, model.model.cp, getattr(model, "routing", None)
    stack = model.model.layers
    for name, layer in list(stack.named_children()):
        stack.add_module(
            name,
            checkpoint_wrapper(
                layer,
                checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                context_fn=lambda: _replay_contexts(generator, cp, routing),
            ),
        )


def _replay_contexts(generator: torch.Generator | None, cp, routing: Routing | None = None) -> tuple:
    """(forward context, recompute context) of one checkpointed layer call: the forward records the dropout
    generator's state, the CP layout and the routing replay in force, the recompute replays them (the
    backward runs outside the micro-batch's replay, and a recomputed router must pick the same experts)."""
    seen: dict = {}

    @contextlib.contextmanager
    def forward():
        seen["rng"] = None if generator is None else generator.get_state()
        seen["layout"] = cp.layout if isinstance(cp, MegatronCP) else None
        seen["routing"] = None if routing is None else routing.current()
        yield

    @contextlib.contextmanager
    def recompute():
        now = None if generator is None else generator.get_state()
        if generator is not None:
            generator.set_state(seen["rng"])
        try:
            with contextlib.ExitStack() as stack:
                if seen["layout"] is not None:
                    stack.enter_context(cp.sharded(seen["layout"]))
                if seen["routing"] is not None:
                    stack.enter_context(routing.replaying(*seen["routing"]))
                yield
        finally:
            if generator is not None:
                generator.set_state(now)

    return forward(), recompute()


def _is_adapter_or_extra(key: str) -> bool:
    return key.endswith("_extra_state") or ".lora." in key
