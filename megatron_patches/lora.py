"""Trainable LoRA adapters of the trainer's K3 and the model-level adapter API.

`LoraWeights` is the adapter of one module (a linear, or one stacked routed-expert projection): it owns
this rank's slices of A and B and knows how the full tensors split across tensor-parallel ranks:

    linear kind     A (full [r, in])    B (full [out, r])   rank-space h = A x
    column          replicated          split dim 0         enter(h): all-reduce its grad (B is local)
    row             split dim 1         replicated          reduce(h): sum the ranks' partial h
    replicated      replicated          replicated          -
    experts w1 / w3 A [E, r, W] repl.   B [E, I, r] dim 1   (column over the intermediate dim I)
    experts w2      A [E, r, I] dim 2   B [E, W, r] repl.   (row over I)

so every rank ends a module with the same full output and identical gradients for replicated slices,
and a TP=n model computes what the TP=1 model does. delta = (alpha / rank) * B(A(dropout(x))).

Determinism across TP sizes: A is initialized from a generator seeded by (seed, module name) over the
full shape and then sliced, and dropout masks are drawn over the full input width from one generator
per model, in module order, and sliced; so TP=1 and TP=n start from the same adapter and draw the same
masks.

Engine naming (the contract with `rollout.lora`): `<module>.lora_A` / `<module>.lora_B`, `<module>` the HF
module path; stacked experts `<prefix>.experts.w1.lora_A` [E, r, in], `.lora_B` [E, out, r].
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.linear import SINGLE, TensorParallel


class LoraWeights(nn.Module):
    """A [*lead, r, in] and B [*lead, out, r] (this rank's slices; `lead` = (E,) for stacked experts).

    `a_split` / `b_split`: the dim of the full tensor split across TP ranks, or None if replicated.
    Built on any device (meta included); `reset` materializes them on `device` as trainable params.
    """

    def __init__(self, name: str, spec: LoraSpec, a_full: tuple[int, ...], b_full: tuple[int, ...],
                 a_split: int | None, b_split: int | None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.name, self.spec, self.tp = name, spec, tp
        self.a_full, self.b_full = tuple(a_full), tuple(b_full)
        self.a_split, self.b_split = a_split, b_split
        self.scale = spec.scale
        self.enabled = True
        self.generator: torch.Generator | None = None  # dropout masks; set by the model builder
        self.A = nn.Parameter(torch.empty(self._local(self.a_full, a_split)))
        self.B = nn.Parameter(torch.empty(self._local(self.b_full, b_split)))

    def _local(self, full: tuple[int, ...], split: int | None) -> tuple[int, ...]:
        if split is None:
            return full
        shape = list(full)
        assert shape[split] % self.tp.size == 0, f"{self.name}: dim {split} of {full} does not split"
        shape[split] //= self.tp.size
        return tuple(shape)

    def _slice(self, full: torch.Tensor, split: int | None) -> torch.Tensor:
        return full if split is None else self.tp.shard(full, split)

    # ------------------------------------------------------------------ state
    def exports(self) -> dict[str, tuple[nn.Parameter, int | None, tuple[int, ...]]]:
        """engine tensor name -> (local param, split dim of the full tensor or None, full shape)."""
        return {f"{self.name}.lora_A": (self.A, self.a_split, self.a_full),
                f"{self.name}.lora_B": (self.B, self.b_split, self.b_full)}

    @torch.no_grad()
    def reset(self, seed: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Fresh adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform bound), B = 0, so the
        adapted module starts equal to its base. The draw depends only on (seed, name), not on TP."""
        g = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(self.name.encode())) % (1 << 63))
        bound = 1.0 / math.sqrt(self.a_full[-1])
        a = torch.empty(self.a_full).uniform_(-bound, bound, generator=g)
        self.A = nn.Parameter(self._slice(a, self.a_split).to(device=device, dtype=dtype).contiguous())
        self.B = nn.Parameter(torch.zeros(self._local(self.b_full, self.b_split), device=device, dtype=dtype))

    # ---------------------------------------------------------------- compute
    def dropout(self, x: torch.Tensor, split_last: bool) -> torch.Tensor:
        """Inverted dropout on the adapter input. The mask is drawn over the full last dim (`split_last`:
        x holds this rank's slice of it) and sliced, so every TP size draws the same mask."""
        p = self.spec.dropout
        if p == 0.0 or not self.training:
            return x
        assert self.generator is not None, "dropout needs the model's generator (set by build_policy)"
        width = x.shape[-1] * (self.tp.size if split_last else 1)
        keep = torch.rand((*x.shape[:-1], width), generator=self.generator, device=x.device) >= p
        if split_last and self.tp.size > 1:
            keep = keep.narrow(-1, self.tp.rank * x.shape[-1], x.shape[-1])
        return x * keep.to(x.dtype) / (1.0 - p)

    def rank_space(self, x: torch.Tensor, a: torch.Tensor | None = None) -> torch.Tensor:
        """h = A dropout(x) (no TP communication). `a` selects one expert's A."""
        a = self.A if a is None else a
        return F.linear(self.dropout(x, split_last=self.a_split is not None), a)

    def delta(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """scale * B(A dropout(x)) for a linear of `kind`; x is that linear's (local) input."""
        h = self.rank_space(x)
        if kind == "column":
            h = self.tp.enter(h)
        elif kind == "row":
            h = self.tp.reduce(h)
        return F.linear(h, self.B) * self.scale


# --------------------------------------------------------------------------- model-level API
def lora_modules(model: nn.Module) -> list[LoraWeights]:
    return [m for m in model.modules() if isinstance(m, LoraWeights)]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters: every adapter's local A and B, in module order."""
    return [p for m in lora_modules(model) for p in (m.A, m.B)]


def _exports(model: nn.Module) -> dict[str, tuple[LoraWeights, nn.Parameter, int | None, tuple[int, ...]]]:
    """engine name -> (owning adapter, local param, TP split dim or None, full shape)."""
    return {name: (m, *entry) for m in lora_modules(model) for name, entry in m.exports().items()}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full adapter tensors in engine naming: detached copies, gathered across TP ranks (a collective:
    every TP rank must call it, and gets the same dict). Dtype and device are the parameters'."""
    out = {}
    for name, (m, p, split, _) in _exports(model).items():
        t = p.detach()
        if split is not None and m.tp.size > 1:
            t = m.tp.all_gather_dim(t, split)
        out[name] = t.clone()
    return out


def adapter_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Full gradients of the adapter tensors in engine naming (gathered across TP like `adapter_state`;
    a collective). None where a parameter has no gradient."""
    out: dict[str, torch.Tensor | None] = {}
    for name, (m, p, split, _) in _exports(model).items():
        g = p.grad
        if g is not None and split is not None and m.tp.size > 1:
            g = m.tp.all_gather_dim(g, split)
        out[name] = None if g is None else g.detach().clone()
    return out


@torch.no_grad()
def average_lora_grads_(model: nn.Module, group=None) -> None:
    """Average the adapters' gradients over the data-parallel group (megatron's, by default) in place:
    one all-reduce of a flat buffer per dtype. A no-op with one data-parallel rank. Every DP rank must
    call it with the same parameters having gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = group if group is not None else ps.get_data_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return
    grads = [p.grad for p in lora_parameters(model) if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def clip_lora_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the adapters' gradients to a global L2 norm of `max_norm`, in place; returns the norm before
    clipping (fp32 scalar, fp64 for fp64 grads; identical on every TP rank). A split gradient's square sum is all-reduced
    over TP; a replicated one (identical on every rank) counts once. Call after any data-parallel
    gradient reduction."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    mods = lora_modules(model)
    split_sq = replicated_sq = None
    for m in mods:
        for p, split in ((m.A, m.a_split), (m.B, m.b_split)):
            if p.grad is None:
                continue
            g = p.grad if p.grad.dtype == torch.float64 else p.grad.float()  # at least fp32
            sq = g.pow(2).sum()
            if split is not None and m.tp.size > 1:
                split_sq = sq if split_sq is None else split_sq + sq
            else:
                replicated_sq = sq if replicated_sq is None else replicated_sq + sq
    device = mods[0].A.device if mods else torch.device("cpu")
    total = torch.zeros((), device=device, dtype=torch.float64 if any(
        p.grad is not None and p.grad.dtype == torch.float64 for p in lora_parameters(model)) else torch.float32)
    if split_sq is not None:
        total = total + mods[0].tp.reduce(split_sq)
    if replicated_sq is not None:
        total = total + replicated_sq
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in lora_parameters(model):
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return norm


@torch.no_grad()
def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full adapter tensors (engine naming, as `adapter_state` returns) into the model's local
    slices (every TP rank passes the same full tensors). Validates every name, shape, dtype and value
    first and writes nothing on error (ValueError)."""
    expected = _exports(model)
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"adapter tensors do not match the adapted modules: missing {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}, unknown {unknown[:4]}"
                         f"{' ...' if len(unknown) > 4 else ''}")
    for name, t in tensors.items():
        _, p, _, full = expected[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"adapter tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != full:
            raise ValueError(f"adapter tensor {name!r}: shape {tuple(t.shape)}, expected {full}")
        if t.dtype != p.dtype:
            raise ValueError(f"adapter tensor {name!r}: dtype {t.dtype}, expected {p.dtype}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"adapter tensor {name!r}: contains NaN or Inf")
    for name, t in tensors.items():
        m, p, split, _ = expected[name]
        p.copy_(m._slice(t, split))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, the model computes the frozen base (the KL reference policy, at no weight cost). Restores
    each adapter's previous state on exit, exceptions included; nests."""
    mods = lora_modules(model)
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in zip(mods, before):
            m.enabled = was
