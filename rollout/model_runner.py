"""The engine's model: built from HF tensors (`build_engine_model`) and run one step at a time (`ModelRunner`).

The model is the shared K3 definition with the engine's linears (MXFP4 or BF16 base, the adapter pool's LoRA
terms). A checkpoint directory is two calls: `config = K3Config.from_json_file(path / "config.json")`, then
`build_engine_model(config, CheckpointSource(path, config), ...)` (`miles_k3.model.checkpoint`: tensors are
read lazily, and a rank of a sharded build reads only its slices), or with `load_state_dict(path, config)`.

A sharded build (`tp=`, an `EngineTP`, `rollout.parallel`) builds this rank's share: each linear's block by
its spec's split (`EngineFactory`), the KDA heads' conv / decay tensors, the routed experts' intermediate
block (EP = 1) or whole local experts (EP), and under DCP the MLA query and kv_b projections for the heads of
the rank's whole DCP group (each DCP rank attends every head of its group over its own positions,
`rollout.dcp`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from miles_k3 import kernels
from miles_k3.model.checkpoint import StateDictSource, TensorSource, keeps_fp32
from miles_k3.model.config import K3Config
from miles_k3.model.layout import tensor_shapes
from miles_k3.model.linear import SINGLE, ExpertsSpec, LinearSpec, TensorParallel
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.modeling import K3ForCausalLM, MediaEmbeds
from miles_k3.model.moe import RoutedExperts
from miles_k3.model.routing import Routing
from rollout.config import EngineConfig
from rollout.forward import DecodeGraphs, hooks, model_step, tapped_rows
from rollout.linears import EngineExperts, EngineLinear, Shard
from rollout.lora import AdapterPool
from rollout.memory import KDAStatePool, KVPagePool
from rollout.parallel import EngineTP
from rollout.state_cache import BatchLayout, PoolStateCache
from rollout.transfer import to_device

if TYPE_CHECKING:
    from rollout.cache_manager import Running

QUANTIZE_MODES = ("none", "experts", "all")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_KDA_HEAD_SPLIT = re.compile(r"\.self_attn\.([qkv]_conv1d\.weight|dt_bias)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w[123])\.weight$")


class EngineFactory:
    """The linear / experts factories of one build, and this rank's block of every tensor it loads."""

    def __init__(self, config: K3Config, pool: AdapterPool | None, quantize: str, tp: TensorParallel):
        self.config, self.pool, self.quantize, self.tp = config, pool, quantize, tp
        self.shards: dict[str, Shard | None] = {}  # "<linear>.weight" -> its block of the full weight

    def _group_query(self, spec: LinearSpec) -> bool:
        """Under DCP: an MLA projection whose rows this rank holds for its whole DCP group's heads."""
        m = _LAYER.match(spec.name)
        return (
            getattr(self.tp, "dcp_size", 1) > 1
            and m is not None
            and self.config.layer_kinds[int(m.group(1))] == "mla"
            and spec.name.rsplit(".", 1)[-1] in ("q_proj", "q_b_proj", "kv_b_proj")
        )

    def linear(self, spec: LinearSpec) -> EngineLinear:
        quantize = self.quantize == "all" and spec.name != "lm_head"
        tp = self.tp
        if tp.size == 1:
            return EngineLinear(spec, self.pool, quantize=quantize)
        shard = None
        if spec.parallel == "column":
            block = tp.dcp_block if self._group_query(spec) else tp.column_block
            shard = Shard(0, *block(spec.out_features))
        elif spec.parallel == "row":
            shard = Shard(1, *tp.column_block(spec.in_features))
        self.shards[f"{spec.name}.weight"] = shard
        return EngineLinear(
            spec,
            self.pool,
            quantize=quantize,
            shard=shard,
            tp=tp,
            reduce=spec.parallel == "row",
            gather=spec.name == "lm_head",
        )

    def experts(self, spec: ExpertsSpec) -> EngineExperts:
        return EngineExperts(spec, self.pool, quantize=self.quantize != "none", tp=self.tp)

    def local_names(self) -> list[str]:
        """The logical tensors this rank reads: all of them, but only its own experts under EP."""
        names = list(tensor_shapes(self.config))
        tp = self.tp
        if tp.size == 1 or tp.ep_size == 1:
            return names
        per_rank = self.config.num_experts // tp.size

        def mine(name: str) -> bool:
            m = _EXPERT.search(name)
            return m is None or int(m.group(1)) // per_rank == tp.rank

        return [n for n in names if mine(n)]

    def read(self, name: str, source: TensorSource) -> torch.Tensor:
        """This rank's block of logical tensor `name`, read from `source` (only that block is read)."""
        tp = self.tp
        if tp.size == 1:
            return source.read(name)

        def rows(dim: int) -> torch.Tensor:
            return source.narrow(name, dim, *tp.column_block(source.shapes[name][dim]))

        if name in self.shards:
            shard = self.shards[name]
            return source.read(name) if shard is None else source.narrow(name, *shard)
        if _KDA_HEAD_SPLIT.search(name):
            return rows(0)
        if name.endswith(".self_attn.A_log"):  # its heads' decay rates, flat
            return source.a_log_heads(name, *tp.column_block(self.config.kda_num_heads))
        m = _EXPERT.search(name)
        if m and tp.ep_size == 1:  # the intermediate block: w1 / w3 [I, W] rows, w2 [W, I] columns
            return rows(1 if m.group(2) == "w2" else 0)
        return source.read(name)  # replicated: norms, AttnRes queries, router, embedding; EP: whole experts


def check_layout(config: K3Config, tp: TensorParallel) -> None:
    """That `config` splits over the sharded build (ValueError naming the field), before anything is built."""
    if tp.size == 1:
        return
    checks = {
        "kda_num_heads": config.kda_num_heads,
        "mla_num_heads": config.mla_num_heads,
        "vocab_size": config.vocab_size,
    }
    if config.first_dense_layers > 0:
        checks["dense_intermediate_size"] = config.dense_intermediate_size
    if any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        checks["num_experts" if tp.ep_size > 1 else "moe_intermediate_size"] = (
            config.num_experts if tp.ep_size > 1 else config.moe_intermediate_size
        )
        if config.num_shared_experts > 0:
            checks["shared experts (moe_intermediate_size * num_shared_experts)"] = config.shared_intermediate
    for field, n in checks.items():
        tp.split(n, field)


def engine_skeleton(config, tp, quantize: str, lora, max_adapters: int, dtype: torch.dtype, device):
    """(the engine's module tree on the meta device, its adapter pool on `device` or None, the factory that
    made it) for `tp`'s rank: what `build_engine_model` loads into, and what `rollout.shard_plan` counts."""
    check_layout(config, tp)
    pool = AdapterPool(lora, max_adapters=max_adapters, dtype=dtype, device=device) if lora is not None else None
    factory = EngineFactory(config, pool, quantize, tp)
    with torch.device("meta"):
        model = K3ForCausalLM(config, linear=factory.linear, experts=factory.experts, tp=tp)
    return model, pool, factory


def build_engine_model(
    config: K3Config,
    state: Mapping[str, torch.Tensor] | TensorSource,
    *,
    quantize: str = "experts",
    lora: LoraSpec | None = None,
    max_adapters: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
) -> tuple[K3ForCausalLM, AdapterPool | None]:
    """`state`: logical HF tensors (as `load_state_dict` returns), or a `TensorSource` such as
    `CheckpointSource(path, config)` (read lazily: a sharded rank reads only its blocks). quantize: "none"
    keeps a BF16 (or `dtype`) base for parity runs; "experts" packs routed experts as MXFP4; "all" also packs
    every projection whose (local) input width is a multiple of 32 (lm_head stays unquantized: it sets the
    log-probs).

    The model runs in `dtype` whatever dtype `state` arrives in (the trainer hands over its fp32 base):
    packed weights are quantized from the tensors as given, every other floating tensor is cast to `dtype`
    except the router/decay parameters the checkpoint keeps in fp32.

    `lora`: the adapters' shape (the trainer's `LoraSpec`), with a pool of `max_adapters` slots; None builds a
    model without adapter buffers and returns no pool. `tp`: this rank's `rollout.parallel.EngineTP` for a
    sharded build (the pool then holds this rank's slices of the adapters)."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if lora is not None and not isinstance(lora, LoraSpec):
        raise ValueError(f"lora must be a LoraSpec or None, got {type(lora).__name__}")
    if tp.size > 1 and not isinstance(tp, EngineTP):
        raise ValueError("build_engine_model: a sharded build takes tp=rollout.parallel.EngineTP(...)")
    model, pool, factory = engine_skeleton(config, tp, quantize, lora, max_adapters, dtype, device)
    if isinstance(state, Mapping) and tp.size == 1:  # the whole model from tensors in memory, as given
        local = {k: v.to(device) for k, v in state.items()}
    else:
        source = StateDictSource(state, config) if isinstance(state, Mapping) else state
        names = factory.local_names()
        unknown = [n for n in names if n not in source.shapes]
        if unknown:
            raise ValueError(f"build_engine_model: the base holds no {unknown[:4]} (config inconsistent with it?)")
        local = {}
        try:
            for name in source.order(names):
                local[name] = factory.read(name, source).to(device)
        finally:
            source.release()
    model.load_state_dict(local, strict=True, assign=True)
    _cast_floating(model, dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), pool


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> None:
    # after loading, so MXFP4 packing above saw the source precision; packed buffers are uint8 and stay
    for prefix, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and t.is_floating_point() and t.dtype != dtype and not keeps_fp32(f"{prefix}.{name}"):
                    cast = t.detach().to(dtype)
                    store[name] = torch.nn.Parameter(cast, requires_grad=False) if store is module._parameters else cast


class ModelRunner:
    """The model side of the engine: its settings (MXFP4 matmul, adapter kernel, CUDA graphs) and one
    forward over a batch of running requests. Runs on the pools given to `use_pools`; the decode graphs
    read those pools by address, so they are built and dropped with them."""

    def __init__(self, model: K3ForCausalLM, config: EngineConfig, adapters: AdapterPool | None):
        self.model, self.config, self.adapters = model.eval(), config, adapters
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.dcp_rank = getattr(model.model.tp, "dcp_rank", 0)  # the KV positions this rank keeps (rollout.dcp)
        self._set_mxfp4_matmul(config.mxfp4_matmul)
        if config.lora_mixed == "triton" and (adapters is None or self.device.type != "cuda"):
            raise ValueError(
                f"lora_mixed='triton' needs an adapter pool and the model on CUDA (model on "
                f"{self.device}, adapter pool {'given' if adapters is not None else 'missing'})"
            )
        if adapters is not None:  # lives on the pool: engines sharing one pool share the last one's
            adapters.mixed_kernel = config.lora_mixed
        self.mla_attention = self._mla_attention(config.mla_attention)
        if config.compile_decode and not self.graphs_apply():
            raise ValueError(
                "compile_decode=True compiles the CUDA-graph decode step: it needs the model on CUDA, "
                "cuda_graphs=True and routed experts that run grouped GEMMs (bf16)"
            )
        self.kv: KVPagePool | None = None
        self.states: KDAStatePool | None = None
        self.graphs: DecodeGraphs | None = None
        # with record_routing: the routers' choices of every forward, kept per KV row (page * page_size + offset)
        # in `routing_table` [rows, MoE layers, top_k] int16, built and dropped with the pools
        self.routing = Routing.of(model, model.config) if config.record_routing else None
        self.routing_table: torch.Tensor | None = None
        self._dropped_graph_counts = (0, 0)  # (captures, replays) of graphs dropped with their pools

    def _set_mxfp4_matmul(self, kind: str) -> None:
        # The setting lives on the model's expert modules: engines sharing one model share the last one's.
        if kind == "auto":
            kind = "triton" if self.device.type == "cuda" else "torch"
        if kind == "triton" and self.device.type != "cuda":
            raise ValueError(f"mxfp4_matmul='triton' needs the model on CUDA, it is on {self.device}")
        for m in self.model.modules():
            if isinstance(m, EngineExperts):
                m.mxfp4_matmul = kind

    def _mla_attention(self, kind: str) -> str:
        if kind == "auto":
            return "triton" if self.device.type == "cuda" and kernels.available(self.device) else "torch"
        if kind == "triton" and not kernels.available(self.device):
            raise ValueError(
                f"mla_attention='triton' needs the model on CUDA (or MILES_K3_KERNELS=interpret) "
                f"and MILES_K3_KERNELS not 0 (model on {self.device})"
            )
        return kind

    def graphs_apply(self) -> bool:
        """CUDA graphs need a decode step without host syncs: routed experts have one when they run grouped
        GEMMs (`RoutedExperts.groups`: bf16; engine experts add their adapter rank), and `DecodeGraphs.usable`
        keeps batches that mix adapters eager. So an fp32 engine decodes eagerly. A speculative verify step
        graphs under the same condition (`rollout.spec.graphs`)."""
        return (
            self.config.cuda_graphs
            and not self.config.record_routing
            and self.device.type == "cuda"
            and all(m.groups(self.dtype) for m in self.model.modules() if isinstance(m, RoutedExperts))
        )

    # ----------------------------------------------------------- pools
    def use_pools(self, kv: KVPagePool, states: KDAStatePool) -> None:
        """Run on these pools from now on, with decode graphs over them where they apply."""
        self.kv, self.states = kv, states
        kv.attention = self.mla_attention
        adapted = self.adapters if self.adapters is not None and self.adapters.A else None
        self.graphs = (
            DecodeGraphs(
                self.model,
                kv,
                states,
                max_batch=self.config.max_running,
                max_seq_len=self.config.max_seq_len,
                capture=True,
                adapters=adapted,
                compile=self.config.compile_decode,
            )
            if self.graphs_apply()
            else None
        )
        if self.routing is not None:
            rows = (kv.allocator.capacity + 2) * kv.page_size  # every page, the sink and zero pages included
            self.routing_table = torch.full(
                (rows, self.routing.width, self.routing.top_k), -1, dtype=torch.int16, device=self.device
            )

    def release_pools(self) -> None:
        self._dropped_graph_counts = self.graph_counts()
        self.kv = self.states = self.graphs = self.routing_table = None

    def _routing_rows(self, r: Running, start: int, end: int) -> list[int]:
        """The routing table's rows (KV rows: page * page_size + offset) of `r`'s positions [start, end)."""
        ps = self.kv.page_size
        return [r.pages[p // ps] * ps + p % ps for p in range(start, end)]

    def routed_experts(self, r: Running) -> torch.Tensor:
        """[len(r.tokens), MoE layers, top_k] int16 on the host: each computed position's experts from the
        table (kept with its KV: a prefix hit reads the routing that computed the cached KV), -1 past `r.pos`."""
        out = torch.full((len(r.tokens), self.routing.width, self.routing.top_k), -1, dtype=torch.int16)
        n = min(r.pos, len(r.tokens))
        if n:
            out[:n] = self.routing_table[to_device(self._routing_rows(r, 0, n), self.device)].cpu()
        return out

    def graph_counts(self) -> tuple[int, int]:
        """Decode graphs captured and replayed since the engine was built, dropped graphs included."""
        captures, replays = self._dropped_graph_counts
        if (g := self.graphs) is not None:
            captures, replays = captures + g.captures, replays + g.replays
        return captures, replays

    # --------------------------------------------------------- forward
    def forward(
        self,
        batch: list[Running],
        ids: list[int] | torch.Tensor,
        lengths: list[int],
        *,
        every_token: bool = False,
        cache_class: type[PoolStateCache] = PoolStateCache,
        media: MediaEmbeds | None = None,
    ) -> torch.Tensor:
        """One model step over `batch`: request n brings lengths[n] tokens (ids, request by request; a device
        tensor [N] for a decode step fed from the previous step's samples) at positions from its `pos`,
        its pages covering them. Returns logits [N, V] at each request's last new token, or with
        `every_token` [sum lengths, V] at every new token, request by request (a speculative verify step;
        eager, never from a decode graph). `cache_class`: the eager step's cache over the pools (a speculative
        verify passes one that writes no KDA state; it implies an eager step). `media`: image features at the
        step's media pads (`rollout.media.packed_media`; a step with them is eager). Enqueues work without
        waiting for the device."""
        if not torch.is_tensor(ids):
            ids = to_device(ids, self.device)
        packed = every_token or any(t > 1 for t in lengths)  # a verify step is always one packed row
        if self.adapters is not None:
            self.adapters.set_batch([self.adapters.slot_of(r.req.adapter) for r in batch], lengths if packed else 1)
        graphed = not packed and cache_class is PoolStateCache and media is None and self.graphs is not None
        if graphed and self.graphs.usable(len(batch), max(r.pos for r in batch) + 1):
            return self.graphs.run(ids, [r.slot for r in batch], [r.pos for r in batch], [r.pages for r in batch])[0]
        layout = BatchLayout.build(
            self.kv,
            [r.slot for r in batch],
            [r.pos for r in batch],
            lengths,
            [r.pages for r in batch],
            self.device,
            dcp_rank=self.dcp_rank,
        )
        cache = cache_class(self.kv, self.states, layout)
        if packed:
            ids_t = ids[None, :]
            cu = to_device(torch.tensor([0, *lengths]).cumsum(0), self.device)
        else:
            ids_t, cu = ids[:, None], None
        with torch.inference_mode():
            if self.routing is None:
                return model_step(self.model, ids_t, cache, cu, every_token, media)
            with self.routing.recording():
                logits = model_step(self.model, ids_t, cache, cu, every_token, media)
                rows = [row for r, n in zip(batch, lengths) for row in self._routing_rows(r, r.pos, r.pos + n)]
                table = self.routing.table(sum(lengths))
                self.routing_table[to_device(rows, self.device)] = table.to(self.device, torch.int16)
            return logits

    def forward_tapped(
        self, batch: list[Running], ids: list[int] | torch.Tensor, taps: dict[str, torch.nn.Module]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A decode step (one token a row, as `forward`) that also returns the outputs of `taps` (modules of the
        model) at each row's token, [1, N, ...] by name: a speculative engine's plain step, whose drafter reads
        them. From a decode graph of its own where graphs serve the batch (`DecodeGraphs.run`)."""
        if not torch.is_tensor(ids):
            ids = to_device(ids, self.device)
        if self.adapters is not None:
            self.adapters.set_batch([self.adapters.slot_of(r.req.adapter) for r in batch], 1)
        if self.graphs is not None and self.graphs.usable(len(batch), max(r.pos for r in batch) + 1):
            return self.graphs.run(ids, [r.slot for r in batch], [r.pos for r in batch], [r.pages for r in batch], taps)
        store: dict[str, torch.Tensor] = {}
        with hooks(taps, store):
            logits = self.forward(batch, ids, [1] * len(batch))
        return logits, tapped_rows(store, len(batch))
