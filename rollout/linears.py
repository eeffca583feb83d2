"""Engine linears: the frozen base as packed MXFP4 (or BF16 for parity runs) plus the pool's LoRA term.

`EngineLinear` and `EngineExperts` plug into the shared K3 definition through its factories
(`miles_k3.model.linear`), so the engine runs the same math as the reference and the trainer. They load
from the HF layout: a dense `<name>.weight` is quantized at load (MXFP4 is idempotent, so a checkpoint
that shipped MXFP4 experts gets back its exact bytes). On CPU the base GEMM dequantizes on the fly;
the CUDA path swaps in a fused dequant-GEMM kernel.

Tensor parallelism (an `EngineTP` of size > 1, `rollout.parallel`): a linear holds the `Shard` of the full
[out, in] weight its spec's split gives this rank (column: a block of output rows; row: a block of input
columns, the output all-reduced after the LoRA term is added, so one collective covers base and adapter;
replicated: the whole weight) and packs that slice as MXFP4. The lm_head is column-split over the vocabulary
and `gather`s its logits. The adapter pool holds the matching slices of A and B (`rollout.lora`).

Linears that read the same input (a KDA mixer's q / k / v / gate / beta projections, an MLA mixer's latent
and gate projections, a GLU's gate and up, an MoE's latent down-projection and shared experts' gate / up)
run as one GEMM over their weights concatenated once (`share_input_gemms`, `SharedInputGEMM`): a decode
step is launch-bound, and each skinny GEMM is a kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.kernels import use_kernels
from miles_k3.model.layers import KDAMixer, MLAMixer
from miles_k3.model.linear import SINGLE, ExpertsSpec, LinearSpec, TensorParallel
from miles_k3.model.moe import GLUMLP, LatentMoE, RoutedExperts
from miles_k3.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from rollout.lora import AdapterPool


class Shard(NamedTuple):
    """This rank's block of a full weight: `length` entries from `start` along `dim` (0: output rows, 1: input
    columns of a linear's [out, in] weight)."""

    dim: int
    start: int
    length: int


def base_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T for a base weight: a decode step's few rows through the few-rows kernel where `use_kernels` says so
    (`miles_k3.kernels.few_rows_linear`: cuBLAS pads a batch-1 row to a tile of 8 or more and takes 4-8 us for a
    weight read in 0.5-2), otherwise F.linear. Both accumulate in fp32 and round once."""
    if use_kernels(x):
        from miles_k3.kernels import few_rows_linear  # imported here: CPU installs never load triton

        if few_rows_linear.supports(x, weight):
            return few_rows_linear.linear(x, weight)
    return F.linear(x, weight)


class EngineLinear(nn.Module):
    """y = x W^T + scale_s B_s A_s x. W is a bf16 parameter, or `weight_packed` / `weight_scale` buffers;
    without an adapter pool (a model built with no LoRA spec), y = x W^T.

    `shard`: this rank's block of the full weight (None: the whole); `reduce`: all-reduce the output over
    `tp` (a row split); `gather`: all-gather the output's last dim over `tp` (the vocab-split lm_head)."""

    def __init__(
        self,
        spec: LinearSpec,
        pool: AdapterPool | None,
        quantize: bool,
        *,
        shard: Shard | None = None,
        tp: TensorParallel = SINGLE,
        reduce: bool = False,
        gather: bool = False,
    ):
        super().__init__()
        self.name, self.pool, self.tp = spec.name, pool, tp
        self.reduce, self.gather = reduce, gather
        self.shared: SharedInputGEMM | None = None  # set by share_input_gemms: the GEMM this one's output is part of
        shape = [spec.out_features, spec.in_features]
        if shard is not None:
            shape[shard.dim] = shard.length
        self.quantized = quantize and shape[1] % 32 == 0
        if self.quantized:
            self.register_buffer("weight_packed", torch.empty(shape[0], shape[1] // 2, dtype=torch.uint8))
            self.register_buffer("weight_scale", torch.empty(shape[0], shape[1] // 32, dtype=torch.uint8))
            self.register_load_state_dict_pre_hook(_quantize_on_load)
        else:
            self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        if pool is not None:
            # column: B's rows ([out, r], dim 0); row: A's columns ([r, in], dim 1)
            pool.register(
                spec.name,
                shape[1],
                shape[0],
                full=(spec.in_features, spec.out_features),
                a_shard=shard if shard is not None and shard.dim == 1 else None,
                b_shard=shard if shard is not None and shard.dim == 0 else None,
            )

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.quantized:  # buffers come from quantize_mxfp4 at load: no per-forward checks
            return dequantize_mxfp4(self.weight_packed, self.weight_scale, dtype=dtype, check=False)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared.output(self, x) if self.shared is not None else base_gemm(x, self.base_weight(x.dtype))
        if self.pool is not None:
            y = self.pool.add_delta(self.name, x, y, self.pool.lead_slots(x))
        if self.reduce:
            y = self.tp.all_reduce(y)
        return self.tp.gather_last_dim(y) if self.gather else y


class SharedInputGEMM:
    """The base GEMM of linears that read the same input, run once over their weights concatenated by rows.

    Made once after the model is loaded on its device (`share_input_gemms`): the concatenated weight (bf16,
    or the MXFP4 packed bytes and scales: rows are independent in both) is allocated once and each member's
    own weight becomes a view of its rows, so memory does not grow and the members' state dicts are
    unchanged. Members keep their LoRA terms, reduce and gather (`EngineLinear.forward` adds them to its
    columns of the shared output).

    `output(member, x)` is safe in any order and for a member called alone: the first member called with an
    input runs the GEMM and keeps the result until every other member has taken its columns for that same
    input object (held by reference, so the same object means the same values: the engine never writes a
    layer's input in place); a call with another input, or a second call for the same input, runs the GEMM
    anew. So a caller that does not follow the layer's pattern gets the right values and pays one GEMM per
    call, as without sharing. Members must be unsharded-output linears of one dtype and packing (checked)."""

    def __init__(self, members: list[EngineLinear]):
        assert len(members) >= 2 and len({m.quantized for m in members}) == 1
        assert not any(m.reduce or m.gather or m.shared is not None for m in members)
        self.quantized = members[0].quantized
        names = ("weight_packed", "weight_scale") if self.quantized else ("weight",)
        self.stored: dict[str, torch.Tensor] = {}
        for name in names:
            parts = [getattr(m, name) for m in members]
            cat = torch.cat([p.detach() for p in parts])
            self.stored[name] = cat
            start = 0
            for m, p in zip(members, parts):
                view = cat[start : start + p.shape[0]]
                if isinstance(p, nn.Parameter):
                    m.weight = nn.Parameter(view, requires_grad=False)
                else:
                    m._buffers[name] = view
                start += p.shape[0]
        bounds = torch.tensor([0] + [_rows(m) for m in members]).cumsum(0).tolist()
        self.columns = {id(m): slice(a, b) for m, a, b in zip(members, bounds[:-1], bounds[1:])}
        self._input: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._pending: set[int] = set()

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.quantized:
            return dequantize_mxfp4(self.stored["weight_packed"], self.stored["weight_scale"], dtype=dtype, check=False)
        return self.stored["weight"]

    def output(self, member: EngineLinear, x: torch.Tensor) -> torch.Tensor:
        """member's base output x W_member^T: its columns of the shared GEMM's output for `x`."""
        key = id(member)
        if self._input is not x or key not in self._pending:
            self._input, self._out = x, base_gemm(x, self.base_weight(x.dtype))
            self._pending = set(self.columns)
        self._pending.discard(key)
        out = self._out[..., self.columns[key]]
        if not self._pending:  # every member has its columns: hold nothing between layers
            self._input = self._out = None
        return out


def _rows(linear: EngineLinear) -> int:
    return (linear.weight_packed if linear.quantized else linear.weight).shape[0]


def _same_input_linears(module: nn.Module) -> list[list[str]]:
    """Attribute paths of the linears `module`'s forward calls on one input tensor, per group (the shared K3
    definition's layers: `miles_k3.model.layers`, `miles_k3.model.moe`)."""
    if isinstance(module, KDAMixer):
        return [["q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj", "g_a_proj"]]
    if isinstance(module, MLAMixer):
        return [["q_proj", "q_a_proj", "kv_a_proj_with_mqa", "g_proj"]]
    if isinstance(module, LatentMoE):
        shared = [f"shared_experts.{n}" for n in module.shared_experts._names[:2]] if module.shared_experts else []
        return [["routed_expert_down_proj", *shared]]
    if isinstance(module, GLUMLP):  # a dense MLP (shared experts are in their MoE's group)
        return [list(module._names[:2])]
    return []


def share_input_gemms(model: nn.Module) -> int:
    """Group the engine linears that read the same input into `SharedInputGEMM`s, and stack each routed-expert
    module's gate and up weights (`EngineExperts.share_gate_up`); once: linears already grouped are left alone.
    Returns the number of groups made."""
    made = 0
    for module in model.modules():  # an MoE before its shared experts' GLU, so they join the MoE's group
        for paths in _same_input_linears(module):
            members = [
                m
                for m in (_submodule(module, p) for p in paths)
                if isinstance(m, EngineLinear) and m.shared is None and not (m.reduce or m.gather)
            ]
            if len(members) < 2 or len({m.quantized for m in members}) != 1:
                continue
            group = SharedInputGEMM(members)
            for m in members:
                m.shared = group
            made += 1
        if isinstance(module, EngineExperts) and not module.gate_up:
            module.share_gate_up()
            made += 1
    return made


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:  # a projection this config does not have (q_proj without q_lora_rank, say)
        return None


def _quantize_on_load(module, state_dict, prefix, *args) -> None:
    dense = state_dict.pop(prefix + "weight", None)
    if dense is not None:
        state_dict[prefix + "weight_packed"], state_dict[prefix + "weight_scale"] = quantize_mxfp4(dense)


class EngineExperts(RoutedExperts):
    """Routed experts with MXFP4 (or BF16) stacked weights and per-expert LoRA for w1/w3/w2 (none without a
    pool).

    Under tensor parallelism (`tp`, an `EngineTP` of size > 1) with `tp.ep_size` = 1 every rank holds every
    expert with the intermediate dim split (w1 / w3 their block of rows, w2 of columns) and the combined
    output is all-reduced once; with `tp.ep_size` = tp size a rank holds num_experts / ep whole experts
    (`local_experts`, global indices), runs the token copies routed to them (all of them: dropless) and the
    same one all-reduce sums the ranks' experts (why not an all-to-all: `rollout.parallel`)."""

    def __init__(self, spec: ExpertsSpec, pool: AdapterPool | None, quantize: bool, tp: TensorParallel = SINGLE):
        super().__init__(spec)
        self.pool, self.tp = pool, tp
        self.mxfp4_matmul = "torch"  # the engine sets EngineConfig.mxfp4_matmul
        e, w, i = spec.num_experts, spec.width, spec.intermediate
        ep = getattr(tp, "ep_size", 1) > 1
        split_e, split_i = (tp.split(e, "num_experts"), i) if ep else (e, tp.split(i, "moe_intermediate_size"))
        if ep:
            self.local_experts = range(tp.rank * split_e, (tp.rank + 1) * split_e)
        self.quantized = quantize and w % 32 == 0 and split_i % 32 == 0
        shapes = {"w1": (split_e, split_i, w), "w3": (split_e, split_i, w), "w2": (split_e, w, split_i)}
        # the full adapter shapes ([E, r, in], [E, out, r]) and this rank's shard of A / B (dim, start, length)
        experts = Shard(0, self.local_experts.start, split_e) if ep else None
        inter = None if ep or tp.size == 1 else Shard(1, tp.rank * split_i, split_i)
        for proj, shape in shapes.items():
            if self.quantized:
                delattr(self, proj)
                self.register_buffer(f"{proj}_packed", torch.empty(*shape[:2], shape[2] // 2, dtype=torch.uint8))
                self.register_buffer(f"{proj}_scale", torch.empty(*shape[:2], shape[2] // 32, dtype=torch.uint8))
            else:
                setattr(self, proj, nn.Parameter(torch.empty(shape), requires_grad=False))
            if pool is not None:
                full_in, full_out = (i, w) if proj == "w2" else (w, i)
                if experts is not None:
                    a_shard = b_shard = experts
                elif inter is not None:  # w1 / w3: B's rows (dim 1 of [E, I, r]); w2: A's columns (dim 2)
                    a_shard, b_shard = (Shard(2, inter.start, inter.length), None) if proj == "w2" else (None, inter)
                else:
                    a_shard = b_shard = None
                pool.register(
                    f"{spec.name}.{proj}",
                    shape[2],
                    shape[1],
                    num_experts=split_e,
                    full=(full_in, full_out, e),
                    a_shard=a_shard,
                    b_shard=b_shard,
                )
        if self.quantized:
            self.register_load_state_dict_pre_hook(self._quantize_stacked)
        self.gate_up = False  # whether w1 / w3 are the row blocks of one stacked "w13" (`share_gate_up`)

    def share_gate_up(self) -> None:
        """Store w1 and w3 as the two row blocks of one stacked weight [E, 2I, in] (`w13`, or `w13_packed` /
        `w13_scale` when MXFP4: rows are independent in both), each a view of its block, so a batch's gate and
        up projections are one grouped GEMM: one launch and one pass over the expert's rows instead of two
        (k3-small on the H200: 10 against 20 us a layer at batch 1, 28 against 36 at batch 256,
        `scripts/bench_decode_kernels.py`). Memory does not grow and the state dict is unchanged; call once,
        after the weights are loaded (`share_input_gemms`)."""
        if self.gate_up:
            return
        for suffix in ("_packed", "_scale") if self.quantized else ("",):
            w1, w3 = getattr(self, f"w1{suffix}"), getattr(self, f"w3{suffix}")
            both = torch.cat([w1.detach(), w3.detach()], dim=1)
            rows = w1.shape[1]
            setattr(self, f"w13{suffix}", both)  # a plain attribute: not in the state dict
            for name, view in ((f"w1{suffix}", both[:, :rows]), (f"w3{suffix}", both[:, rows:])):
                if isinstance(w1, nn.Parameter):
                    setattr(self, name, nn.Parameter(view, requires_grad=False))
                else:
                    self._buffers[name] = view
        self.gate_up = True

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x, indices, weights)
        out = (
            self._local_expert_forward(x, indices, weights)
            if self.tp.ep_size > 1
            else super().forward(x, indices, weights)
        )
        return self.tp.all_reduce(out)

    def _local_expert_forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: this rank's experts' weighted outputs for every token ([N, W], zero for tokens
        routed elsewhere). Copies routed to other ranks sort after the local ones (a static shape: no host
        read of the counts) and their rows are dropped from the sum."""
        k, n_local = indices.shape[1], len(self.local_experts)
        local = indices.reshape(-1) - self.local_experts.start
        key = torch.where((local >= 0) & (local < n_local), local, n_local)
        order = key.argsort(stable=True)
        token_of = order // k
        counts = torch.zeros(n_local + 1, dtype=torch.long, device=key.device)
        counts.index_add_(0, key, torch.ones_like(key))
        ys = self._experts(x[token_of], counts[:n_local], token_of)
        keep = (key[order] < n_local)[:, None]
        contrib = torch.where(keep, ys * weights.reshape(-1)[order, None], 0.0)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, contrib.to(out.dtype))
        return out

    @staticmethod
    def _quantize_stacked(module, state_dict, prefix, *args) -> None:
        # runs after RoutedExperts' stacking hook (hooks run in registration order)
        for proj in RoutedExperts._PROJ:
            dense = state_dict.pop(prefix + proj, None)
            if dense is not None:
                state_dict[f"{prefix}{proj}_packed"], state_dict[f"{prefix}{proj}_scale"] = quantize_mxfp4(dense)

    def expert_weight(self, proj: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        return self.stacked_weight(proj, dtype, e)

    def stacked_weight(
        self, proj: str, dtype: torch.dtype, index: int | slice | torch.Tensor = slice(None)
    ) -> torch.Tensor:
        """The `proj` weights of experts `index` (default every expert: [E, out, in]; a tensor of expert ids
        gives one weight per id), decoded in one pass when packed."""
        if self.quantized:
            return dequantize_mxfp4(
                getattr(self, f"{proj}_packed")[index], getattr(self, f"{proj}_scale")[index], dtype, check=False
            )
        return getattr(self, proj)[index]

    def groups(self, dtype: torch.dtype) -> bool:
        """bf16 and 16-byte aligned adapter rows (rank a multiple of 8); grouped only for batches whose rows
        share one adapter slot (`_experts`)."""
        return super().groups(dtype) and (self.pool is None or self.pool.spec.rank % 8 == 0)

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
        """Grouped GEMMs when `groups` and one adapter (or none) serves the batch, or rows of different
        adapters get their terms from the Triton kernel (`AdapterPool.mixed_kernel`); otherwise a loop
        over experts with per-token slots."""
        if self.groups(xs.dtype):
            if self.pool is None or self.pool.batch_slot is not None:
                return self._experts_grouped(xs, counts)
            if self.pool.mixed_kernel == "triton":
                return self._experts_grouped(xs, counts, token_of)
        return self._experts_looped(xs, counts, token_of)

    def _experts_grouped(
        self, xs: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As `RoutedExperts._experts_grouped`; with `token_of` (each row's token) the LoRA terms follow each
        row's own adapter slot (mixed batches) instead of the batch's one slot."""
        proj = self._grouped_projs(xs.shape[0], counts, token_of)
        return proj(("w2",), self._act(*proj(("w1", "w3"), xs)))[0]

    def _expert_of_row(self, counts: torch.Tensor, num_rows: int) -> torch.Tensor:
        # output_size keeps repeat_interleave from reading the counts on the host (no sync, capturable)
        n = counts.numel()
        experts = torch.arange(n, device=counts.device)
        if self.tp.size > 1 and self.tp.ep_size > 1:
            # expert parallelism: rows past the local experts' (copies routed elsewhere) take the last local
            # expert; their outputs are dropped
            counts = torch.cat([counts, (num_rows - counts.sum()).reshape(1)])
            experts = torch.arange(n + 1, device=counts.device).clamp(max=n - 1)
        return torch.repeat_interleave(experts, counts, output_size=num_rows)

    def _grouped_projs(self, num_rows: int, counts: torch.Tensor, token_of: torch.Tensor | None = None):
        """The engine's `RoutedExperts._grouped_proj`: proj(names, x) -> [x @ W_name[e]^T + its LoRA term for
        each name] over each expert's rows of x, for names that read the same x, so ("w1", "w3") runs as one
        GEMM over `w13` after `share_gate_up` (not for mixed adapters, whose per-row kernel adds into a whole
        base output in place). The experts' row offsets (a cumsum: two launches) are computed once, and only
        when a torch grouped GEMM or the adapter's grouped term reads them; the Triton kernels read counts."""
        cumsum: list[torch.Tensor] = []  # not functools.cache: dynamo cannot trace it in a full graph (compile_decode)

        def offs() -> torch.Tensor:
            if not cumsum:
                cumsum.append(torch.cumsum(counts, 0, dtype=torch.int32))
            return cumsum[0]

        # "torch": decoding every expert costs one pass over the packed bytes, cheaper than a launch chain
        # per expert; "triton" decodes tiles next to the MMA and writes no bf16 copy.
        if self.quantized and self.mxfp4_matmul == "triton":
            from rollout.kernels.expert_gemm import mxfp4_grouped_matmul

            def base(name: str, x: torch.Tensor) -> torch.Tensor:
                return mxfp4_grouped_matmul(x, counts, getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"))
        elif self.quantized and num_rows < counts.numel():
            # Fewer rows than experts (small-batch decode: bs=1 routes top-k rows): decode only the weights
            # the rows use, one per row, instead of every expert. The row count is a static shape, so the
            # choice needs no look at the routing.
            expert_of_row = self._expert_of_row(counts, num_rows)

            def base(name: str, x: torch.Tensor) -> torch.Tensor:
                return torch.bmm(self.stacked_weight(name, x.dtype, expert_of_row), x[:, :, None])[:, :, 0]
        else:

            def base(name: str, x: torch.Tensor) -> torch.Tensor:
                w = self.stacked_weight(name, x.dtype)
                if not self.quantized and use_kernels(x):  # decode sizes: the Triton grouped GEMM (its docstring)
                    from rollout.kernels import expert_gemm

                    if expert_gemm.supports(x, w):
                        return expert_gemm.grouped_matmul(x, counts, w)
                return torch._grouped_mm(x, w.transpose(1, 2), offs=offs())

        if token_of is not None:  # mixed adapters: per-row (slot, expert) matrices through the Triton kernel
            slot_of_row = self.pool.device_token_slots()[token_of]
            expert_of_row = self._expert_of_row(counts, num_rows)

            def one(name: str, x: torch.Tensor) -> torch.Tensor:  # (in place into a fresh base output)
                return self.pool.add_rows_delta(
                    f"{self.spec.name}.{name}", x, base(name, x), slot_of_row, expert_of_row
                )

            return lambda names, x: [one(name, x) for name in names]

        def with_delta(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            delta = None if self.pool is None else self.pool.grouped_delta(f"{self.spec.name}.{name}", x, offs())
            return y if delta is None else y + delta

        def proj(names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
            if names == ("w1", "w3") and self.gate_up:  # one GEMM over the stacked pair, split by columns
                ys = base("w13", x).chunk(2, dim=-1)
            else:
                ys = [base(name, x) for name in names]
            return [with_delta(name, x, y) for name, y in zip(names, ys)]

        return proj

    def _experts_looped(self, xs: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
        slots = self.pool.token_slots() if self.pool is not None else None
        copy_slots = slots[token_of.cpu()] if slots is not None else None
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                seg = xs[start : start + n]
                seg_slots = copy_slots[start : start + n] if copy_slots is not None else None
                gate = self._proj("w1", e, seg, seg_slots)
                up = self._proj("w3", e, seg, seg_slots)
                ys[start : start + n] = self._proj("w2", e, self._act(gate, up), seg_slots)
            start += n
        return ys

    def _proj(self, proj: str, e: int, x: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, self.expert_weight(proj, e, x.dtype))
        return y if self.pool is None else self.pool.add_delta(f"{self.spec.name}.{proj}", x, y, slots, expert=e)
