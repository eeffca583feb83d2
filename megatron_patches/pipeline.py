"""Pipeline parallelism for the trainer: which decoder layers each stage holds, and the adapter gather.

    ranges = stage_layers(93, 8)                      # even: 5 stages of 12 layers, then 3 of 11
    ranges = stage_layers(6, 3, pp_layers=[1, 3, 2])  # uneven: range(0, 1), range(1, 4), range(4, 6)
    full = gather_over_stages(local)                  # every PP rank: the union of the stages' dicts

A stage is `K3ForCausalLM(..., layers=ranges[pp_rank])` (see `miles_k3.model.modeling`): the embedding on the
first stage (and the last when embeddings are tied), the final AttnRes mix, norm and lm_head on the last;
`build_policy` builds this rank's from megatron's PP rank. Between stages the AttnRes residual state travels
packed into the one tensor megatron's p2p carries (`modeling.pack_residual`); `megatron_patches.schedule` runs
megatron's 1F1B over the micro-batches.

Stages hold disjoint layers, so their adapters are disjoint: an export gathers them over the PP group
(`gather_over_stages`, which `lora.adapter_state` / `adapter_grads` call), and the gradient norm sums the
stages' square sums (`lora.clip_lora_grad_norm_` all-reduces its total over the PP group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def stage_layers(num_layers: int, pp_size: int, pp_layers: Sequence[int] | None = None) -> list[range]:
    """The decoder-layer range of each of `pp_size` stages, in order.

    pp_layers: the number of layers of each stage (len == pp_size, each >= 1, summing to `num_layers`); None =
    even, the first `num_layers % pp_size` stages one layer more (the last stage also computes the logits).
    A split that is not possible is a ValueError naming `pp_layers`."""
    if pp_size < 1:
        raise ValueError(f"pipeline-parallel size must be >= 1, got {pp_size}")
    if pp_layers is None:
        if num_layers < pp_size:
            raise ValueError(
                f"pp_layers: {num_layers} layers cannot fill {pp_size} pipeline stages (every stage needs >= 1 layer)"
            )
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (s < extra) for s in range(pp_size)]
    else:
        counts = list(pp_layers)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
            raise ValueError(f"pp_layers must be a list of integers (layers per stage), got {pp_layers!r}")
        if len(counts) != pp_size:
            raise ValueError(f"pp_layers: {len(counts)} stage counts {counts} for {pp_size} pipeline stages")
        if min(counts) < 1:
            raise ValueError(f"pp_layers: every stage needs >= 1 layer, got {counts}")
        if sum(counts) != num_layers:
            raise ValueError(f"pp_layers: {counts} sum to {sum(counts)}, but the model has {num_layers} layers")
    starts = [sum(counts[:s]) for s in range(pp_size)]
    return [range(a, a + n) for a, n in zip(starts, counts)]


def this_stage(num_layers: int, pp_layers: Sequence[int] | None = None) -> range:
    """This rank's layer range from megatron's pipeline-parallel rank and size."""
    return stage_layers(num_layers, ps.get_pipeline_model_parallel_world_size(), pp_layers)[
        ps.get_pipeline_model_parallel_rank()
    ]


def broadcast_tensors(
    named: dict[str, torch.Tensor | None] | None, src_stage: int, device: torch.device | str
) -> dict[str, torch.Tensor | None]:
    """Stage `src_stage`'s dict of tensors (None values allowed) on every PP rank: a collective over the PP
    group; the other stages pass None. Names, shapes and dtypes go first (pickled, small), then one flat
    broadcast per dtype on `device` (nccl or gloo alike). The source gets its own dict back."""
    group = ps.get_pipeline_model_parallel_group()
    src = dist.get_global_rank(group, src_stage)
    is_src = ps.get_pipeline_model_parallel_rank() == src_stage
    meta = [[(k, None if v is None else (tuple(v.shape), v.dtype)) for k, v in named.items()] if is_src else None]
    dist.broadcast_object_list(meta, src=src, group=group)
    entries = meta[0]
    out: dict[str, torch.Tensor | None] = {name: None for name, m in entries if m is None}
    for dtype in sorted({m[1] for _, m in entries if m is not None}, key=str):
        same = [(name, shape) for name, m in entries if m is not None and m[1] == dtype for shape in [m[0]]]
        if is_src:
            flat = torch.cat([named[name].reshape(-1) for name, _ in same])
        else:
            flat = torch.empty(sum(torch.Size(s).numel() for _, s in same), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for name, shape in same:
            n = torch.Size(shape).numel()
            out[name] = flat[offset : offset + n].view(shape)
            offset += n
    return named if is_src else {name: out[name] for name, _ in entries}


def gather_over_stages(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The union of every stage's dict on every PP rank, stage by stage (model order): each stage passes
    what it holds (its layers' adapters, or their gradients; None values allowed) and every stage gets the
    whole. A collective over the PP group: every rank calls it (the TP / EP ranks of each stage too, each in
    its own PP group). `lora.adapter_state` / `adapter_grads` end with it. Tensors land on the device of
    the given ones (CPU when a stage passes none)."""
    size = ps.get_pipeline_model_parallel_world_size()
    if size == 1:
        return tensors
    device = next((t.device for t in tensors.values() if t is not None), torch.device("cpu"))
    rank = ps.get_pipeline_model_parallel_rank()
    out: dict[str, torch.Tensor | None] = {}
    for stage in range(size):
        got = broadcast_tensors(tensors if stage == rank else None, stage, device)
        if set(got) & set(out):
            raise ValueError(
                f"gather_over_stages: two stages hold tensors of the same name, {sorted(set(got) & set(out))[:4]}"
            )
        out |= got
    return out
