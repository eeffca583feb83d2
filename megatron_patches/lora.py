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
Under expert parallelism the stacked expert factors are split on dim 0 (the expert dim) over the EP group
instead (expert TP is 1 there): each rank holds the adapters of its own experts (`shards`).

Determinism across TP sizes: A is initialized from a generator seeded by (seed, module name) over the
full shape and then sliced, and dropout masks are drawn over the full input width from one generator
per model, in module order, and sliced; so TP=1 and TP=n start from the same adapter and draw the same
masks. (Data and expert parallelism give each rank other tokens, so their masks are those of its rows.)

Replicas and their gradients (`reduce_lora_grads_`, called by the trainer after backward): a factor held
whole by several ranks that see different tokens gets its gradient summed over them, since each rank's
loss is already normalized by the global batch's denominators:
    dense factors (every non-expert module)    over data-parallel x context-parallel
    routed-expert factors                      over megatron's expert-data-parallel group
Megatron does none of this for parameters outside its DDP wrapper. Tensor-parallel replicas need no
reduction, with or without sequence parallelism: every linear reads the whole sequence (the decoder
layer gathers it before each mixer / MLP), and the column / row rules above leave the same full gradient
on every TP rank. Replicas start identical: A is drawn from (seed, name) alone, B is zero
(`check_lora_replicas` verifies it).

Engine naming (the contract with `rollout.lora`): `<module>.lora_A` / `<module>.lora_B`, `<module>` the HF
module path; stacked experts `<prefix>.experts.w1.lora_A` [E, r, in], `.lora_B` [E, out, r], E the global
expert count (gathered over EP in global expert order).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megatron_patches.expert_parallel import ExpertParallel
from megatron_patches.pipeline import gather_over_stages
from miles_k3.model.linear import SINGLE, TensorParallel
from miles_k3.model.lora_spec import LoraSpec


class LoraWeights(nn.Module):
    """A [*lead, r, in] and B [*lead, out, r] (this rank's slices; `lead` = (E,) for stacked experts).

    `a_split` / `b_split`: the dim of the full tensor split across the ranks of `shards`, or None if
    replicated. `shards` is the TP share (default) or, for experts under expert parallelism, the EP share;
    `tp` is always the TP share (the column / row communication of `delta`, the dropout mask slices).
    `expert`: a stacked routed-expert factor (its data replicas are the expert-data-parallel group).
    Built on any device (meta included); `reset` materializes them on `device` as trainable params.
    """

    def __init__(
        self,
        name: str,
        spec: LoraSpec,
        a_full: tuple[int, ...],
        b_full: tuple[int, ...],
        a_split: int | None,
        b_split: int | None,
        tp: TensorParallel = SINGLE,
        shards: TensorParallel | ExpertParallel | None = None,
        expert: bool = False,
    ):
        super().__init__()
        self.name, self.spec, self.tp = name, spec, tp
        self.shards = shards if shards is not None else tp
        self.expert = expert
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
        assert shape[split] % self.shards.size == 0, f"{self.name}: dim {split} of {full} does not split"
        shape[split] //= self.shards.size
        return tuple(shape)

    def _slice(self, full: torch.Tensor, split: int | None) -> torch.Tensor:
        return full if split is None else self.shards.shard(full, split)

    # ------------------------------------------------------------------ state
    def exports(self) -> dict[str, tuple[nn.Parameter, int | None, tuple[int, ...]]]:
        """engine tensor name -> (local param, split dim of the full tensor or None, full shape)."""
        return {
            f"{self.name}.lora_A": (self.A, self.a_split, self.a_full),
            f"{self.name}.lora_B": (self.B, self.b_split, self.b_full),
        }

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
        # x holds this rank's slice of its last dim when A's input dim is split over TP
        split_last = self.shards is self.tp and self.a_split == len(self.a_full) - 1
        return F.linear(self.dropout(x, split_last=split_last), a)

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


def _gather(m: LoraWeights, t: torch.Tensor, split: int | None) -> torch.Tensor:
    return t if split is None or m.shards.size == 1 else m.shards.all_gather_dim(t, split)


def _over_stages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every pipeline stage's tensors (the same dict on every stage; with one stage the
    identity)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return tensors
    return gather_over_stages(tensors)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full adapter tensors in engine naming: detached copies, gathered across TP ranks, across EP ranks
    (experts stacked in global order) and across pipeline stages (a collective: every rank must call it,
    and gets the same dict). Dtype and device are the parameters'."""
    out = {name: _gather(m, p.detach(), split).clone() for name, (m, p, split, _) in _exports(model).items()}
    return _over_stages(out)


def adapter_shards(model: nn.Module) -> dict[str, tuple[torch.Tensor, tuple[tuple[int, int], ...]]]:
    """This rank's own blocks of the adapter, gathering nothing: engine name -> (the local tensor, detached,
    not copied; its box in the full tensor, (start, stop) per dim). Only this pipeline stage's modules; a
    replicated factor's box is the whole tensor (and its data / context / expert-data replicas hold the same
    box). What a shard-to-shard sync sends from (`miles_k3.trainer.adapter_sync`)."""
    out = {}
    for name, (m, p, split, full) in _exports(model).items():
        box = [(0, n) for n in full]
        if split is not None and m.shards.size > 1:
            step = full[split] // m.shards.size
            box[split] = (m.shards.rank * step, (m.shards.rank + 1) * step)
        out[name] = (p.detach(), tuple(box))
    return out


def adapter_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Full gradients of the adapter tensors in engine naming (gathered like `adapter_state`; a
    collective). None where a parameter has no gradient (on every rank of its split, as after
    `reduce_lora_grads_`)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, (m, p, split, _) in _exports(model).items():
        out[name] = None if p.grad is None else _gather(m, p.grad.detach(), split).clone()
    return _over_stages(out)


# --------------------------------------------------------------------------- replicas and gradients
def _replica_groups(model: nn.Module) -> list[tuple[str, object, list[LoraWeights]]]:
    """(what, group, adapters) for each group of ranks that hold the same adapters on different tokens:
    the dense ones over data x context parallel, the routed-expert ones over expert data parallel. Groups
    of one rank are left out. The same list, in the same order, on every rank of a group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return []
    mods = lora_modules(model)
    out = []
    for what, group, chosen in (
        (
            "data x context parallel",
            ps.get_data_parallel_group(with_context_parallel=True),
            [m for m in mods if not m.expert],
        ),
        ("expert data parallel", ps.get_expert_data_parallel_group(), [m for m in mods if m.expert]),
    ):
        if dist.get_world_size(group) > 1 and chosen:
            out.append((what, group, chosen))
    return out


def _sum_grads(group, mods: list[LoraWeights]) -> None:
    """Sum the gradients of `mods`' factors over `group` (one all-reduce of a flat buffer per dtype). A
    factor with no gradient on a rank adds zeros; one with no gradient on any rank stays None (a flag per
    factor travels in the same buffer), so the optimizer treats it as the single-process run does."""
    import torch.distributed as dist

    params = [p for m in mods for p in (m.A, m.B) if p.requires_grad]
    for dtype in sorted({p.dtype for p in params}, key=str):
        same = [p for p in params if p.dtype == dtype]
        device = same[0].device
        parts = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device)
            for p in same
        ]
        flags = torch.tensor([float(p.grad is not None) for p in same], dtype=dtype, device=device)
        flat = torch.cat(parts + [flags])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p, had in zip(same, flat[-len(same) :].tolist()):
            g = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if not had:
                p.grad = None
            elif p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)


@torch.no_grad()
def reduce_lora_grads_(model: nn.Module) -> None:
    """Sum every replicated adapter gradient over the ranks that hold the replica (see the module
    docstring), in place. The trainer calls it after backward and before clipping, on every rank; each
    rank's loss must already be normalized by the global batch's denominators (token count, groups), so
    the sum is the gradient of the global loss. A no-op on one rank."""
    for _, group, mods in _replica_groups(model):
        _sum_grads(group, mods)


@torch.no_grad()
def check_lora_replicas(model: nn.Module) -> None:
    """ValueError naming the first adapter tensor that differs between ranks meant to hold the same values:
    the data / expert-data replicas (`reduce_lora_grads_`) and the TP ranks of an unsplit factor. A
    collective; call it once after building or loading the adapters."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    checks = [
        (what, group, [(f"{m.name}.lora_{ab}", p) for m in mods for ab, p in (("A", m.A), ("B", m.B))])
        for what, group, mods in _replica_groups(model)
    ]
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        unsplit = [
            (f"{m.name}.lora_{ab}", p)
            for m in lora_modules(model)
            for ab, p, split in (("A", m.A, m.a_split), ("B", m.B, m.b_split))
            if split is None
        ]
        checks.append(("tensor parallel", ps.get_tensor_model_parallel_group(), unsplit))
    for what, group, named in checks:
        for dtype in sorted({p.dtype for _, p in named}, key=str):
            same = [(n, p) for n, p in named if p.dtype == dtype]
            flat = torch.cat([p.detach().reshape(-1) for _, p in same])
            lo, hi = flat.clone(), flat.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            offset = 0
            for n, p in same:
                if not torch.equal(lo[offset : offset + p.numel()], hi[offset : offset + p.numel()]):
                    raise ValueError(f"adapter tensor {n!r} differs between the {what} ranks that replicate it")
                offset += p.numel()


@torch.no_grad()
def clip_lora_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the adapters' gradients to a global L2 norm of `max_norm`, in place; returns the norm before
    clipping (fp32 scalar, fp64 for fp64 grads; identical on every rank). The norm covers every rank that
    holds distinct gradients: a split factor's square sum is all-reduced over its split (TP, or EP for
    experts), every pipeline stage adds its own adapters, and a replicated factor counts once. Call after
    `reduce_lora_grads_` (data replicas then hold the same gradients)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    mods = lora_modules(model)
    device = mods[0].A.device if mods else torch.device("cpu")
    # square sums: [split over TP, split over EP, replicated]; foreach norms, a few launches for the hundreds
    # of adapter tensors (the train step is host-bound on CUDA: one launch per tensor and op adds up)
    by_slot: list[list[torch.Tensor]] = [[], [], []]
    for m in mods:
        for p, split in ((m.A, m.a_split), (m.B, m.b_split)):
            if p.grad is not None:
                slot = 2 if split is None or m.shards.size == 1 else 1 if isinstance(m.shards, ExpertParallel) else 0
                by_slot[slot].append(p.grad)
    grads = [g for gs in by_slot for g in gs]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    sq = [
        torch.stack(torch._foreach_norm(gs, 2, dtype=dtype)).pow(2).sum()
        if gs
        else torch.zeros((), device=device, dtype=dtype)
        for gs in by_slot
    ]
    if ps.model_parallel_is_initialized():
        for slot, size, group in (
            (0, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group),
            (1, ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group),
        ):
            if size > 1:
                dist.all_reduce(sq[slot], group=group())
        total = sq[0] + sq[1] + sq[2]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    else:
        total = sq[0] + sq[1] + sq[2]
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for kind in {g.dtype for g in grads}:
        torch._foreach_mul_([g for g in grads if g.dtype == kind], coef.to(kind))
    return norm


def _other_stages(model: nn.Module, local: dict) -> set[str]:
    """Engine names of the adapters that other pipeline stages hold (empty with one stage)."""
    from megatron.core import parallel_state as ps

    from miles_k3.model.lora_spec import adaptable_modules

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return set()
    spec = model.lora_spec  # set by build_policy
    names = {f"{m}.lora_{ab}" for m in adaptable_modules(model.config) if spec.targets_module(m) for ab in "AB"}
    return names - set(local)


@torch.no_grad()
def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full adapter tensors (engine naming, as `adapter_state` returns) into the model's local
    slices (every TP / EP rank passes the same full tensors). Validates every name, shape, dtype and value
    first and writes nothing on error (ValueError). Under pipeline parallelism every stage may pass the
    whole model's tensors: a stage takes its own and skips the adapters of the other stages' layers."""
    expected = _exports(model)
    tensors = {k: v for k, v in tensors.items() if k in expected or k not in _other_stages(model, expected)}
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(
            f"adapter tensors do not match the adapted modules: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unknown {unknown[:4]}"
            f"{' ...' if len(unknown) > 4 else ''}"
        )
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
