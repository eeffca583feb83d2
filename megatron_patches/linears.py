"""The trainer's linears and routed experts: megatron-core parallel linears, frozen base, LoRA on top.

They plug into the shared K3 definition through its factories (`miles_k3.model.linear`), so they keep
its contract: `forward(x [..., in]) -> [..., out]` (a tensor, not megatron's (output, bias) tuple), no
bias, base weight under `<name>.weight` (this rank's slice when TP > 1), frozen.

- column (`ColumnLinear`, megatron ColumnParallelLinear): full input, this rank's output slice; the
  base's input gradient is all-reduced by megatron (allreduce_dgrad). The lm_head is one too: its
  output is this rank's vocab slice (`megatron_patches.vocab_parallel`).
- row (`RowLinear`, RowParallelLinear, input_is_parallel): this rank's input slice, full output summed
  across ranks by megatron.
- replicated (`ReplicatedLinear`): the whole weight on every rank (low-rank latent / gate projections).
- routed experts (`ParallelExperts`): at EP=1 the intermediate dim I is split across TP ranks (w1 / w3
  column, w2 row, one all-reduce of the expert outputs) and every rank runs all experts on all its
  tokens. Under expert parallelism (`megatron_patches.expert_parallel`) each rank holds num_experts / ep
  whole experts (expert TP is 1) and the token copies travel to them by all-to-all; the adapter naming and
  the LoRA math per expert are the same either way.

Megatron on CPU: the layers are built with `use_cpu_initialization=True, perform_initialization=False`
(weights come from the checkpoint), under a meta device at build time; a frozen weight routes the
GEMM through `linear_with_frozen_weight`, which needs no CUDA. Sequence parallelism is off (its
gathers use CUDA-only global buffers in megatron-core 0.16.1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from megatron_patches.expert_parallel import ExpertParallel, expert_share
from megatron_patches.lora import LoraWeights
from megatron_patches.parallel import MegatronTP
from miles_k3.model.linear import ExpertsSpec, LinearSpec
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.moe import RoutedExperts


def _no_init(weight: torch.Tensor) -> None:
    # Base weights always come from a checkpoint (or the reference init, sharded); never initialized here.
    return None


def _adapter(spec: LinearSpec, lora: LoraSpec | None, tp: MegatronTP) -> LoraWeights | None:
    if lora is None or not lora.targets_module(spec.name):
        return None
    a_split, b_split = {"column": (None, 0), "row": (1, None), "replicated": (None, None)}[spec.parallel]
    return LoraWeights(
        spec.name, lora, (lora.rank, spec.in_features), (spec.out_features, lora.rank), a_split, b_split, tp
    )


class ColumnLinear(ColumnParallelLinear):
    def __init__(self, spec: LinearSpec, config: ModelParallelConfig, tp: MegatronTP, lora: LoraSpec | None):
        super().__init__(
            spec.in_features,
            spec.out_features,
            config=config,
            init_method=_no_init,
            bias=False,
            gather_output=False,
            skip_bias_add=True,
        )
        self.weight.requires_grad_(False)
        self.tp = tp
        self.lora = _adapter(spec, lora, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = super().forward(x)
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora.delta(x, "column")
        return y


class RowLinear(RowParallelLinear):
    def __init__(self, spec: LinearSpec, config: ModelParallelConfig, tp: MegatronTP, lora: LoraSpec | None):
        super().__init__(
            spec.in_features,
            spec.out_features,
            config=config,
            init_method=_no_init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        self.weight.requires_grad_(False)
        self.lora = _adapter(spec, lora, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = super().forward(x)
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora.delta(x, "row")
        return y


class ReplicatedLinear(nn.Module):
    def __init__(self, spec: LinearSpec, config: ModelParallelConfig, tp: MegatronTP, lora: LoraSpec | None):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(spec.out_features, spec.in_features, dtype=config.params_dtype), requires_grad=False
        )
        self.lora = _adapter(spec, lora, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora.delta(x, "replicated")
        return y


class ParallelExperts(RoutedExperts):
    """Routed experts of this rank, w1 / w3 [E_local, I_local, W], w2 [E_local, W, I_local] (HF per-expert
    names with global indices in state dicts, as the base class does), per-expert stacked LoRA
    `lora[proj]`. `ep` (megatron's expert-model-parallel share by default): EP=1 holds every expert with
    I split over TP (I_local = I / tp); EP > 1 holds the experts `ep.local_experts(E)` whole (TP must be 1)
    and dispatches token copies to them.

    Communication per forward (TP > 1): the routed token copies enter the split region once (gradient
    all-reduce), the w1 / w3 adapters' rank-space inputs enter once each, the w2 outputs and the w2
    adapter's rank-space partials are all-reduced once each; never per expert. EP > 1: the counts, the
    copies and the outputs cross the EP group once each (`ExpertParallel.dispatch` / `combine`).

    Compute: bf16 uses grouped GEMMs (`torch._grouped_mm`, base and adapter factors); fp32 / fp64 loop
    over experts on contiguous slices (the exactness tests run that path).
    """

    def __init__(
        self,
        spec: ExpertsSpec,
        config: ModelParallelConfig,
        tp: MegatronTP,
        lora: LoraSpec | None,
        ep: ExpertParallel | None = None,
    ):
        super().__init__(spec)
        self.tp = tp
        self.ep = ep if ep is not None else expert_share(tp.size)  # refuses EP > 1 with TP > 1
        self.local_experts = self.ep.local_experts(spec.num_experts)
        e, w, i = spec.num_experts, spec.width, spec.intermediate
        local_e, local_i = len(self.local_experts), tp.split(i, "moe_intermediate_size")
        dtype = config.params_dtype
        self.w1 = nn.Parameter(torch.empty(local_e, local_i, w, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(local_e, local_i, w, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local_e, w, local_i, dtype=dtype), requires_grad=False)
        adapters = {}
        if lora is not None:
            r = lora.rank
            # full shapes and split dims: over TP (the intermediate dim) at EP=1, over EP (the expert dim) else
            if self.ep.size > 1:
                full = {
                    "w1": ((e, r, w), (e, i, r), 0, 0),
                    "w3": ((e, r, w), (e, i, r), 0, 0),
                    "w2": ((e, r, i), (e, w, r), 0, 0),
                }
            else:
                full = {
                    "w1": ((e, r, w), (e, i, r), None, 1),
                    "w3": ((e, r, w), (e, i, r), None, 1),
                    "w2": ((e, r, i), (e, w, r), 2, None),
                }
            shards = self.ep if self.ep.size > 1 else tp
            for proj, (a_full, b_full, a_split, b_split) in full.items():
                if lora.targets_module(f"{spec.name}.{proj}"):
                    adapters[proj] = LoraWeights(
                        f"{spec.name}.{proj}", lora, a_full, b_full, a_split, b_split, tp, shards=shards, expert=True
                    )
        self.lora = nn.ModuleDict(adapters)
        # grouped GEMMs on CUDA need 16-byte aligned rank-space rows
        self._rank_aligned = all(lw.spec.rank % 8 == 0 for lw in adapters.values())

    def _routed(self, xs: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
        if self.ep.size == 1:
            return self._experts(xs, counts, token_of)
        rows, local_counts, plan = self.ep.dispatch(xs, counts)
        return self.ep.combine(self._experts(rows, local_counts, None), plan)

    def groups(self, dtype: torch.dtype) -> bool:
        return super().groups(dtype) and self._rank_aligned

    def _on(self, proj: str) -> LoraWeights | None:
        lw = self.lora[proj] if proj in self.lora else None
        return lw if lw is not None and lw.enabled else None

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
        # bf16 (the training dtype) with aligned ranks runs one grouped GEMM per projection and adapter
        # factor; other dtypes loop over experts.
        if self.groups(xs.dtype):
            return self._experts_grouped(xs, counts)
        return self._experts_loop(xs, counts)

    def _experts_grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)

        def gmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # per expert e: rows of e @ w[e]^T
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

        xs_base = self.tp.enter(xs)  # as in the loop path: adapters enter in rank space instead
        gate, up = gmm(xs_base, self.w1), gmm(xs_base, self.w3)
        for proj in ("w1", "w3"):
            lw = self._on(proj)
            if lw is not None:
                h = self.tp.enter(gmm(lw.dropout(xs, split_last=False), lw.A))
                delta = gmm(h, lw.B) * lw.scale
                gate, up = (gate + delta, up) if proj == "w1" else (gate, up + delta)
        act = self._act(gate, up)
        ys = self.tp.reduce(gmm(act, self.w2))
        lw2 = self._on("w2")
        if lw2 is not None:
            h2 = self.tp.reduce(gmm(lw2.dropout(act, split_last=True), lw2.A))
            ys = ys + gmm(h2, lw2.B) * lw2.scale
        return ys

    def _experts_loop(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        segments = [(e, start, n) for e, (start, n) in enumerate(_spans(counts.tolist())) if n]
        if not segments:
            # No rows for this rank's experts (expert parallelism). Stay in the graph, so this rank runs the
            # backward exchanges too, and give the adapters a zero gradient (what they get from an empty
            # batch of rows), not None, as the other ranks' adapters of the same tensors get theirs.
            on = [lw for lw in map(self._on, self.lora) if lw is not None]
            zero = sum((lw.A.sum() + lw.B.sum() for lw in on), xs.new_zeros(())) * 0
            return xs * 0 + zero
        # Base GEMMs read xs through `enter` (their input gradient is partial per rank); the adapters read
        # the raw xs and enter in rank space instead, so no gradient is all-reduced twice.
        xs_base = self.tp.enter(xs)
        rank_h = {}
        for proj in ("w1", "w3"):
            lw = self._on(proj)
            if lw is not None:
                rank_h[proj] = self.tp.enter(torch.cat([lw.rank_space(xs[s : s + n], lw.A[e]) for e, s, n in segments]))
        partial, h2 = [], []
        lw2 = self._on("w2")
        for e, s, n in segments:  # segments tile the rows in order, so row s of a concatenation is row s here
            seg = xs_base[s : s + n]
            gate, up = F.linear(seg, self.w1[e]), F.linear(seg, self.w3[e])
            if "w1" in rank_h:
                gate = gate + F.linear(rank_h["w1"][s : s + n], self.lora["w1"].B[e]) * self.lora["w1"].scale
            if "w3" in rank_h:
                up = up + F.linear(rank_h["w3"][s : s + n], self.lora["w3"].B[e]) * self.lora["w3"].scale
            act = self._act(gate, up)
            partial.append(F.linear(act, self.w2[e]))
            if lw2 is not None:
                h2.append(lw2.rank_space(act, lw2.A[e]))
        ys = self.tp.reduce(torch.cat(partial))
        if lw2 is not None:
            h = self.tp.reduce(torch.cat(h2))
            ys = ys + torch.cat([F.linear(h[s : s + n], lw2.B[e]) for e, s, n in segments]) * lw2.scale
        return ys


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each expert's rows in the expert-sorted token copies."""
    out, start = [], 0
    for n in counts:
        out.append((start, n))
        start += n
    return out
