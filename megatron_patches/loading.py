"""A rank's base weights read from a `TensorSource`, each tensor cut to this rank's slice as it is read.

    source = CheckpointSource(path, config)                    # headers only: names, shapes, validation
    local = local_state(source, names, lambda name, src: src.narrow(name, 0, start, length),
                        dtype=torch.bfloat16, device="cuda")

`names` are the tensors this rank holds (its pipeline stage's layers, its experts: what the local model's
`state_dict()` names); `slicer(name, source)` returns this rank's part of tensor `name` by asking the source
for it (`source.read` for a replicated tensor, `source.narrow(name, dim, start, length)` for a
tensor-parallel slice, `source.a_log_heads` for a KDA decay vector). A `CheckpointSource` then reads only
those bytes from the safetensors files, so a rank's peak host memory is about its own shard (plus one mapped
file's touched pages, and one tensor's slice in flight while it is cast and moved), not the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from miles_k3.model.checkpoint import TensorSource, stored_dtype

Slicer = Callable[[str, TensorSource], torch.Tensor]


def local_state(
    source: TensorSource,
    names: Iterable[str],
    slicer: Slicer,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """{name: slicer(name, source)} for `names` (in their given order), each on `device` in `dtype` (fp32 for
    router / decay parameters, `stored_dtype`). Reads run in the source's cheapest order (a checkpoint: file
    by file, so each file is mapped once) and the source is released at the end. Unknown names: ValueError."""
    names = list(names)
    unknown = [n for n in names if n not in source.shapes]
    if unknown:
        raise ValueError(f"local_state: {len(unknown)} name(s) the source does not hold, e.g. {unknown[:4]}")
    out: dict[str, torch.Tensor] = {}
    try:
        for name in source.order(names):
            # the source's read is already a fresh CPU tensor: `to` copies only to change device or dtype
            out[name] = slicer(name, source).to(device=device, dtype=stored_dtype(name, dtype))
    finally:
        source.release()
    return {name: out[name] for name in names}
