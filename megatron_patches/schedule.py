"""The trainer's forward / backward over micro-batches, through megatron's own pipeline schedules.

    mbs = [MicroBatch(packed.input_ids, packed.cu_seqlens, payload=packed) for packed in micro_batches]

    def loss_fn(policy, hidden, mb):            # last stage only; hidden [1, N, D] final-normed
        logp, _ = token_logprobs(policy, hidden[0, mb.payload.positions], mb.payload.targets, T)
        loss = -(logp * weights).sum() / global_token_count   # normalized by the WHOLE batch's denominators
        return loss, {"logp": logp.detach()}

    results = forward_backward(policy, mbs, loss_fn)   # LoRA grads accumulated; on every PP rank:
    results[i]["loss"], results[i]["logp"]              # micro-batch i's loss and outputs
    old = forward_only(policy, mbs, lambda policy, hidden, mb: {"logp": ...})   # no grad (pi_old, KL ref)

One path for every layout: `megatron.core.pipeline_parallel.get_forward_backward_func()` picks megatron's
1F1B schedule (`forward_backward_pipelining_without_interleaving`) for PP > 1 and its no-pipelining schedule
for PP = 1. Every PP rank calls with the same micro-batches (each stage reads input_ids / cu_seqlens; only the
last reads the payload); only the last stage runs `loss_fn`, and its per-micro-batch results are broadcast to
every PP rank (the driver on rank 0 reads them).

The loss is used as returned: the schedule adds nothing. Megatron divides a returned loss by
num_microbatches (and by its token count in its 3-tuple form) unless `calculate_per_token_loss` is set, in
which case the division happens only in `finalize_model_grads_func`; we set `calculate_per_token_loss` and no
`finalize_model_grads_func`, so the gradient is that of sum_i loss_i: give each micro-batch's loss already
divided by the whole batch's denominators (token count, sequence count, ...), and the result equals the
whole batch's loss in one backward. Data-parallel and gradient-norm reductions are the caller's, after.

Variable micro-batch lengths: megatron's p2p needs each received tensor's shape. We set `variable_seq_lengths`
(megatron then sends each tensor's 3-int shape before it; its config check wants the MoE token dispatcher
type `alltoall`, which names megatron's dispatcher, not ours, so it is set only to pass that check). That also
carries the width change of the packed AttnRes state from stage edge to stage edge
(`[prefix_sum, bank]`, (1 + n_blocks) * D, n_blocks growing with depth). The alternatives: padding every
micro-batch to one length runs the padding through every layer (real FLOPs in KDA, MLA and the MoE) to save
a 24-byte message per send; `adjust_tensor_shapes_fn` fixes one shape for the whole call, so it cannot follow
per-micro-batch lengths (and exists only in the non-interleaved schedule).

Interleaved virtual stages are not used: megatron's interleaved schedule takes the model as a list of chunks
(one `K3ForCausalLM(layers=...)` per virtual stage; the stage builds here already take any layer range) with
one data iterator each, and needs megatron's virtual-pipeline size in its parallel state
(`init_parallel` does not set one). Every adapter API (`lora_parameters`, `adapter_state`, the gradient norm,
PEFT export) and the trainer would take a list of chunks instead of one policy; that plumbing is left for
when the 1F1B bubble, (PP - 1) / (M + PP - 1) of the step, is measured to matter.

CPU: megatron's schedules and p2p allocate on CUDA; `megatron_patches.cpu_device.use_cpu_devices` redirects
them when there is no CUDA (called here). The stage's own collectives (TP, SP) run inside forward and in
backward in the same order on every rank of a stage, so gloo does not hang on them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from megatron_patches.cpu_device import use_cpu_devices
from megatron_patches.pipeline import broadcast_tensors
from miles_k3.model.context import ZigzagLayout


@dataclass
class MicroBatch:
    """One micro-batch of packed sequences. `payload`: whatever `loss_fn` / `output_fn` need besides the
    hidden states (targets, positions, masks, advantages, ...), read on the last stage only."""

    input_ids: torch.Tensor  # [1, N]
    cu_seqlens: torch.Tensor | None = None  # [S + 1] int32, starts at 0, ends at N
    payload: Any = None
    # Under context parallelism: this rank's zigzag share of the row (set by the schedule); the stages then run
    # on its local tokens and `loss_fn` / `output_fn` get hidden states of those tokens ([1, 2c, D], in
    # `layout.positions` order)
    layout: ZigzagLayout | None = None
    # The engine's expert ids of each token [N, MoE layers, top_k] (`miles_k3.model.routing`): the policy's
    # routers replay them (`replay`) or only measure their agreement with them; under context parallelism each
    # rank takes its tokens' rows
    routing: torch.Tensor | None = None
    replay: bool = True


LossFn = Callable[[nn.Module, torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
OutputFn = Callable[[nn.Module, torch.Tensor, MicroBatch], dict[str, torch.Tensor]]


class _MegatronStage(nn.Module):
    """The policy as megatron's schedules see it: `.model_type`, `.config` (a TransformerConfig for the
    schedule and p2p), `.set_input_tensor` (what p2p received from the previous stage)."""

    model_type = ModelType.encoder_or_decoder

    def __init__(self, policy: nn.Module, config: TransformerConfig):
        super().__init__()
        self.module, self.config = policy, config
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        self.input_tensor = tensors[0]

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        model = self.module.model
        inputs = None if model.first else self.input_tensor
        table = mb.routing
        if table is not None and mb.layout is not None:
            table = mb.layout.shard(table, dim=0, pad_value=-1)
        with self.module.routing.replaying(table, mb.replay) if table is not None else contextlib.nullcontext():
            if mb.layout is None:
                out = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, inputs=inputs)
            else:  # the layout carries the sequence boundaries; the backward needs none
                with model.cp.sharded(mb.layout):
                    out = model(mb.layout.shard(mb.input_ids), inputs=inputs)
        if not self.module.model.last and out.dtype != self.config.pipeline_dtype:
            raise ValueError(
                f"pipeline send of dtype {out.dtype}, but the receiving stage expects "
                f"{self.config.pipeline_dtype} (build_policy's dtype)"
            )
        return out


# a policy's TransformerConfig depends only on how it was built: validated once, not on every call
_CONFIGS: weakref.WeakKeyDictionary[nn.Module, TransformerConfig] = weakref.WeakKeyDictionary()


def _schedule_config(policy: nn.Module) -> TransformerConfig:
    if policy not in _CONFIGS:
        _CONFIGS[policy] = _build_schedule_config(policy)
    return _CONFIGS[policy]


def _build_schedule_config(policy: nn.Module) -> TransformerConfig:
    c = policy.config
    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=1,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=policy.residual_dtype,
        params_dtype=policy.residual_dtype,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # see the module docstring
        calculate_per_token_loss=True,  # megatron leaves our (globally normalized) loss undivided
        # a sent stage output keeps only its autograd node (the packed bank is up to (1 + n_blocks) x the
        # residual's bytes); its backward then runs through megatron's custom_backward
        deallocate_pipeline_outputs=True,
        use_cpu_initialization=True,
    )


def _run(
    policy: nn.Module, micro_batches: Sequence[MicroBatch], fn, forward_only: bool
) -> list[dict[str, torch.Tensor]]:
    if not micro_batches:
        raise ValueError("micro_batches is empty")
    use_cpu_devices()
    cp = policy.model.cp
    if cp.size > 1:
        micro_batches = [replace(mb, layout=cp.split(mb.input_ids.shape[1], mb.cu_seqlens)) for mb in micro_batches]
    stage = _MegatronStage(policy, _schedule_config(policy))
    no_tokens = torch.zeros((), dtype=torch.int)  # megatron's token count (unused: no finalize func)

    def on_last_stage(hidden: torch.Tensor, mb: MicroBatch):
        # megatron's 3-tuple form (loss, token count, what to store); with calculate_per_token_loss it
        # divides the loss by nothing
        if forward_only:
            return torch.zeros((), device=hidden.device), no_tokens, dict(fn(policy, hidden, mb))
        loss, outputs = fn(policy, hidden, mb)
        return loss, no_tokens, {**outputs, "loss": loss.detach()}

    def step(data_iterator, model):
        mb = next(data_iterator)
        return model(mb), lambda hidden: on_last_stage(hidden, mb)

    with torch.no_grad() if forward_only else torch.enable_grad():
        store = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micro_batches),
            model=stage,
            num_microbatches=len(micro_batches),
            seq_length=max(mb.input_ids.shape[1] for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    return _share_results(store, len(micro_batches), micro_batches[0].input_ids.device)


def _share_results(store: list[dict[str, torch.Tensor]], n: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The last stage's per-micro-batch results on every PP rank."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return store
    last = ps.is_pipeline_last_stage()
    flat = {f"{i}/{k}": v.detach() for i, d in enumerate(store) for k, v in d.items()} if last else None
    got = broadcast_tensors(flat, ps.get_pipeline_model_parallel_world_size() - 1, device)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for key, v in got.items():
        i, name = key.split("/", 1)
        out[int(i)][name] = v
    return out


def forward_backward(
    policy: nn.Module, micro_batches: Sequence[MicroBatch], loss_fn: LossFn
) -> list[dict[str, torch.Tensor]]:
    """Forward and backward of every micro-batch (1F1B over the PP stages): the LoRA parameters' `.grad`
    accumulate the gradient of sum_i loss_i (zero them before). `loss_fn(policy, hidden [1, N, D], mb)` runs
    on the last stage and returns (loss, outputs): the loss already normalized by the whole batch's
    denominators (the schedule divides by nothing), outputs a dict of tensors. Returns, on every PP rank,
    per micro-batch `outputs` plus "loss" (detached)."""
    return _run(policy, micro_batches, loss_fn, forward_only=False)


def forward_only(
    policy: nn.Module, micro_batches: Sequence[MicroBatch], output_fn: OutputFn
) -> list[dict[str, torch.Tensor]]:
    """Forward of every micro-batch without grad (pi_old / KL-reference log-probs): `output_fn(policy,
    hidden, mb)` -> dict of tensors on the last stage; returns them per micro-batch on every PP rank."""
    return _run(policy, micro_batches, output_fn, forward_only=True)
