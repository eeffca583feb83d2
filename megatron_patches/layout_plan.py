"""The layout planner's counts: build one rank of a layout on the meta device and count its bytes.

    layout = Layout.parse("tp=8,pp=8,ep=1,cp=1", gpus=64)
    for stage in LayoutPlanner(config, LoraSpec(rank=16), recompute=True).stages(layout, tokens=32768):
        stage.base_experts, stage.lora, stage.optimizer, stage.activations   # bytes, per rank of that stage
        stage.recompute_peak, stage.trainer_total

No separate formula to drift: a rank is the trainer's own `build_policy(config, None, lora, device="meta")`
inside a torch.distributed "fake" world of the layout's size (`FakeStore`, so N ranks need no N processes)
with megatron's groups from `init_parallel`; its bytes are read off the module tree.

What each count is, per rank (every rank of one pipeline stage holds the same shapes: the TP / EP splits are
even, `build_policy` checks that they divide):
- base: every base parameter and persistent buffer, in the dtype the real build keeps it (`stored_dtype`:
  the train dtype, router / decay tensors fp32); `base_experts` the routed experts' w1 / w2 / w3 (the trainer
  keeps them in the train dtype, as it computes with them; only the engine packs them as MXFP4).
- lora: the adapters (`lora_parameters`) in the train dtype; `lora_grads` their gradients (same bytes).
- optimizer: what `torch.optim.AdamW` (the trainer's optimizer) keeps per adapter element after a step,
  measured on a small tensor of the train dtype (exp_avg + exp_avg_sq); the per-tensor `step` scalar lives
  on the host and is left out.
- activations: the tensors autograd saves for backward in one micro-batch's forward of this stage (decoder
  layers, and on the last stage the chunked log-prob head), caught with `saved_tensors_hooks` during a
  meta-device forward of the built stage at two small token counts and extended linearly to `tokens`
  (tokens / cp per rank). Left out: the base weights autograd also saves (counted above), and any saved
  tensor internal to an attention core that the GPU kernels recompute from their (counted) inputs: the
  [.., T, T] scores / mask of the CPU SDPA path (flash attention saves O(T)), and the per-chunk blocks of the
  torch chunked KDA, [B, H, n_chunks, C, ..] (5 dims or more), which fla's chunk_kda does not keep. The MoE,
  linears, norms, AttnRes and LoRA tensors are those the trainer saves on any device. `in_flight`: micro-batches whose
  activations a stage holds at the peak of megatron's 1F1B schedule (pp - stage).
  With activation recompute (`parallel.recompute`, `build_policy(recompute=True)`) a micro-batch in flight
  holds only each decoder layer's inputs (the residual state and AttnRes bank entering it, counted once per
  storage) and what is saved outside the layers (embedding, final norm, log-prob head); one layer's full
  activations come back once, during that layer's backward (`recompute_peak`, the largest layer's). The same
  meta forward counts both: each saved tensor is charged to the layer whose forward saved it. Under expert parallelism
  the probe runs the EP=1 build of the same stage (the dispatch's split sizes are data); with balanced
  routing a rank receives as many token copies as it sends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import nn

from megatron_patches.lora import lora_parameters
from megatron_patches.model import build_policy
from megatron_patches.parallel import destroy_parallel, init_parallel
from megatron_patches.pipeline import stage_layers
from miles_k3.model.config import K3Config
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.modeling import bank_rows

# Token counts of the two meta forwards whose saved bytes are extended linearly (multiples of the KDA chunk).
_PROBE_TOKENS = (128, 256)


@dataclass(frozen=True)
class Layout:
    """tp * pp * cp * dp ranks (megatron's order); expert parallelism inside dp * cp (EP > 1 needs TP = 1)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},cp={self.cp},ep={self.ep},dp={self.dp}"

    @classmethod
    def parse(cls, text: str, gpus: int) -> "Layout":
        """ "tp=8,pp=8,ep=1,cp=1" (dp optional: gpus / (tp * pp * cp)); ValueError names the bad part."""
        sizes: dict[str, int] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in ("tp", "pp", "cp", "ep", "dp") or key in sizes:
                raise ValueError(f"--layout {text!r}: expected comma-separated tp=, pp=, cp=, ep=, dp= (each once)")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--layout {text!r}: {key} must be an integer >= 1, got {value!r}")
            sizes[key] = int(value)
        model = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
        if "dp" not in sizes:
            if gpus % model:
                raise ValueError(f"--layout {text!r}: tp * pp * cp = {model} does not divide --gpus {gpus}")
            sizes["dp"] = gpus // model
        layout = cls(**sizes)
        if layout.world != gpus:
            raise ValueError(f"--layout {text!r}: tp * pp * cp * dp = {layout.world}, not --gpus {gpus}")
        if (layout.dp * layout.cp) % layout.ep:
            raise ValueError(f"--layout {text!r}: ep={layout.ep} must divide dp * cp = {layout.dp * layout.cp}")
        if layout.ep > 1 and layout.tp > 1:
            raise ValueError(f"--layout {text!r}: expert parallelism needs tp=1 (expert TP is 1)")
        return layout


@dataclass(frozen=True)
class StageBytes:
    """The bytes one rank of pipeline stage `stage` holds (see the module docstring for what each counts)."""

    stage: int
    layers: range
    base_experts: int
    base_other: int
    lora: int
    lora_grads: int
    optimizer: int
    activations: int  # held per micro-batch in flight (with recompute: the layers' inputs and the rest)
    in_flight: int  # micro-batches held at the 1F1B peak
    recompute_peak: int = 0  # with recompute: one layer's activations, rebuilt during its backward (once)

    @property
    def base(self) -> int:
        return self.base_experts + self.base_other

    @property
    def trainer_total(self) -> int:
        return (
            self.base
            + self.lora
            + self.lora_grads
            + self.optimizer
            + self.activations * self.in_flight
            + self.recompute_peak
        )


@contextlib.contextmanager
def fake_rank(layout: Layout, rank: int) -> Iterator[None]:
    """Rank `rank` of `layout` in this process: a fake torch.distributed world (no peers, collectives do
    nothing) and megatron's groups from `init_parallel`, both torn down on exit. Megatron's gloo side groups
    are not formed (gloo cannot run on a fake store; the trainer's tensors do not use them)."""
    if dist.is_initialized():
        raise ValueError("fake_rank needs a process without a torch.distributed world")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        init_parallel(layout.tp, layout.pp, layout.cp, layout.ep, gloo_groups=False)  # a fake world has no gloo
        yield
    finally:
        destroy_parallel()
        dist.destroy_process_group()


def param_bytes(model: nn.Module) -> dict[str, int]:
    """base_experts / base_other / lora bytes of a built model (meta or real): parameters and persistent
    buffers by role, each at its own dtype. Routed experts are the `experts.w1/w2/w3` tensors."""
    adapters = {id(p) for p in lora_parameters(model)}
    out = {"base_experts": 0, "base_other": 0, "lora": 0}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        tensors = list(module._parameters.items()) + [
            (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]
        for name, t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            if id(t) in adapters:
                out["lora"] += n
            elif prefix.endswith(".experts") and name in ("w1", "w2", "w3"):
                out["base_experts"] += n
            else:
                out["base_other"] += n
    return out


@functools.cache
def adamw_bytes_per_element(dtype: torch.dtype) -> int:
    """Bytes `torch.optim.AdamW` keeps per parameter element after a step, as the trainer builds it (its
    state tensors of the parameter's shape: exp_avg and exp_avg_sq, in the parameter's dtype)."""
    p = nn.Parameter(torch.zeros(64, dtype=dtype))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, eps=1e-8)
    p.grad = torch.ones_like(p)
    opt.step()
    return (
        sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t) and t.shape == p.shape)
        // p.numel()
    )


@dataclass(frozen=True)
class ActivationBytes:
    """What one micro-batch's forward of a stage saves for backward, split the way recompute needs it."""

    layers: tuple[int, ...]  # per decoder layer: what its forward saves (storages first saved there)
    inputs: int  # the decoder layers' inputs (residual state and AttnRes bank), each storage once
    other: int  # saved outside the decoder layers: embedding, final mix and norm, log-prob head

    def held(self, recompute: bool) -> int:
        """Bytes a micro-batch in flight holds: everything, or (recompute) the layers' inputs and the rest."""
        return self.inputs + self.other if recompute else sum(self.layers) + self.other

    def peak(self, recompute: bool) -> int:
        """Bytes rebuilt once, on top, during backward: the largest layer's activations under recompute."""
        return max(self.layers, default=0) if recompute else 0

    @staticmethod
    def extend(a: "ActivationBytes", b: "ActivationBytes", t0: int, t1: int, t: int) -> "ActivationBytes":
        """Each count extended linearly from `a` (at t0 tokens) and `b` (at t1) to t tokens."""

        def line(x: int, y: int) -> int:
            return max(0, round(x + (y - x) * (t - t0) / (t1 - t0)))

        return ActivationBytes(
            tuple(line(x, y) for x, y in zip(a.layers, b.layers)), line(a.inputs, b.inputs), line(a.other, b.other)
        )


def saved_bytes(model: nn.Module, config: K3Config, tokens: int, dtype: torch.dtype) -> ActivationBytes:
    """Bytes autograd saves for one meta forward of this stage over one packed row of `tokens` tokens (the
    last stage: through the chunked log-prob head), per decoder layer and outside them, and the bytes of the
    layers' inputs; see the module docstring for what is left out."""
    from megatron_patches.vocab_parallel import token_logprobs

    stage = model.model
    params = {id(p) for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}  # held, so no id is reused while counting
    per_layer: dict[int, int] = {}
    inputs: dict[int, torch.Tensor] = {}
    current: list[int | None] = [None]  # the decoder layer whose forward is running

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def base_of(t: torch.Tensor) -> torch.Tensor:
        return t._base if t._base is not None else t

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = base_of(t)
        kernel_internal = base.dim() >= 5 or (base.dim() >= 2 and base.shape[-1] == base.shape[-2] == tokens)
        if id(base) not in params and not kernel_internal and id(base) not in seen:
            seen[id(base)] = base
            per_layer[current[0]] = per_layer.get(current[0], 0) + nbytes(base)
        return t

    def enter(i: int):
        def hook(module, args):
            current[0] = i
            h, blocks = args[0], args[1]
            for x in (h, *blocks):
                inputs[id(base_of(x))] = base_of(x)

        return hook

    def leave(module, args, out):
        current[0] = None

    hooks = []
    for i, layer in enumerate(stage.layers):
        hooks += [layer.register_forward_pre_hook(enter(i)), layer.register_forward_hook(leave)]
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    inp = None
    if not stage.first:
        width = (1 + bank_rows(config, stage.layer_range.start)) * config.hidden_size
        inp = torch.empty(1, tokens, width, dtype=dtype, device="meta", requires_grad=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = stage(ids, cu_seqlens=None, inputs=inp)
            if stage.last:
                token_logprobs(model, hidden[0], ids[0], 1.0, with_entropy=True)
    finally:
        for h in hooks:
            h.remove()
    return ActivationBytes(
        tuple(per_layer.get(i, 0) for i in range(len(stage.layers))),
        sum(nbytes(t) for t in inputs.values()),
        per_layer.get(None, 0),
    )


@dataclass(frozen=True)
class _Counts:
    layers: range
    params: dict[str, int]
    lora_elements: int


def _build(
    config: K3Config, lora: LoraSpec, layout: Layout, stage: int, dtype: torch.dtype, pp_layers: list[int] | None
) -> nn.Module:
    """The meta model of the first rank of stage `stage` (megatron's order puts PP outermost); inside fake_rank."""
    assert ps.get_pipeline_model_parallel_rank() == stage
    return build_policy(config, None, lora, dtype=dtype, device="meta", pp_layers=pp_layers)


def _first_rank(layout: Layout, stage: int) -> int:
    return stage * (layout.world // layout.pp)


class LayoutPlanner:
    """Per-stage bytes of layouts of one model. Shapes depend on tp, pp and ep only (CP and DP replicate
    them), so each stage is built in a fake world of tp * pp * ep ranks (dp = ep), once per (tp, pp, ep)."""

    def __init__(
        self,
        config: K3Config,
        lora: LoraSpec,
        *,
        dtype: torch.dtype = torch.bfloat16,
        pp_layers: list[int] | None = None,
        recompute: bool = False,
    ):
        self.config, self.lora, self.dtype, self.pp_layers = config, lora, dtype, pp_layers
        self.recompute = recompute  # count activations as `parallel.recompute` keeps them
        self._counts: dict[tuple[int, int, int, int], _Counts] = {}
        self._probes: dict[tuple[int, int, int], tuple[ActivationBytes, ActivationBytes]] = {}

    def _stage(self, layout: Layout, stage: int) -> _Counts:
        key = (layout.tp, layout.pp, layout.ep, stage)
        if key not in self._counts:
            shapes = Layout(tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=layout.ep)
            with fake_rank(shapes, _first_rank(shapes, stage)):
                model = _build(self.config, self.lora, shapes, stage, self.dtype, self.pp_layers)
                self._counts[key] = _Counts(
                    model.model.layer_range, param_bytes(model), sum(p.numel() for p in lora_parameters(model))
                )
        return self._counts[key]

    def _probe(self, layout: Layout, stage: int) -> tuple[ActivationBytes, ActivationBytes]:
        # EP's dispatch sizes are data (a meta forward cannot run them): probe the EP=1 build of this stage.
        # With balanced routing a rank receives as many token copies as it sends, so it saves the same.
        key = (layout.tp, layout.pp, stage)
        if key not in self._probes:
            single = Layout(tp=layout.tp, pp=layout.pp)
            with fake_rank(single, _first_rank(single, stage)):
                model = _build(self.config, self.lora, single, stage, self.dtype, self.pp_layers)
                self._probes[key] = tuple(saved_bytes(model, self.config, t, self.dtype) for t in _PROBE_TOKENS)
        return self._probes[key]

    def stages(self, layout: Layout, tokens: int | None, *, recompute: bool | None = None) -> list[StageBytes]:
        """One entry per pipeline stage: the bytes one of its ranks holds with micro-batches of `tokens`
        tokens (None: parameters only, activations 0, no forward run), with activation recompute or without
        (None: as the planner was built)."""
        recompute = self.recompute if recompute is None else recompute
        stage_layers(self.config.num_hidden_layers, layout.pp, self.pp_layers)  # ValueError names pp_layers
        opt_per = adamw_bytes_per_element(self.dtype)
        (t0, t1), out = _PROBE_TOKENS, []
        for stage in range(layout.pp):
            c = self._stage(layout, stage)
            held = peak = 0
            if tokens is not None:
                acts = ActivationBytes.extend(*self._probe(layout, stage), t0, t1, -(-tokens // layout.cp))
                held, peak = acts.held(recompute), acts.peak(recompute)
            out.append(
                StageBytes(
                    stage,
                    c.layers,
                    c.params["base_experts"],
                    c.params["base_other"],
                    c.params["lora"],
                    c.params["lora"],
                    c.lora_elements * opt_per,
                    held,
                    layout.pp - stage,
                    peak,
                )
            )
        return out
