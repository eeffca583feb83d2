"""The trainer side of the colocated loop: the megatron-core policy (frozen BF16 base + LoRA), its optimizer,
and one GRPO update per call.

Every trainer rank holds one TrainWorker and calls `train` with the same whole batch: a data-parallel rank takes
its share of the groups (`micro_batches`), megatron's schedule runs its micro-batches through the pipeline
stages, and megatron's parallel linears do the tensor-parallel communication. `adapter_shards()` gives this
rank's own adapter blocks (what the shard-to-shard sync and the checkpoint's gather send), `adapter_state()`
the full tensors (gathered over TP, EP and PP; for the library and tests); `state_dict()` / `load_state_dict()`
carry optimizer, LR schedule and RNG states for checkpoints (the adapter travels in PEFT form).

Image prompts: a batch's `SequenceMedia` (the features the engine was given, frozen tower and projector) reach
the first stage's embeddings through `policy.media_feed` (`megatron_patches.model.MediaFeed`), each piece's
packed row with its `Packed.media`, around every schedule call.
"""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any, NamedTuple

import torch

from miles_k3.algo import policy_loss
from miles_k3.model.config import K3Config
from miles_k3.offload import Parked, resident_bytes
from miles_k3.trainer.batch import TrainBatch
from miles_k3.trainer.micro_batches import Piece, combine_metrics, data_share, even_out, for_group, micro_batches


class TrainWorker:
    def __init__(
        self,
        config: K3Config,
        base_state: dict[str, torch.Tensor],
        lora,
        *,
        loss,
        algo,
        optim,
        temperature: float,
        dtype: torch.dtype,
        device: str,
        seed: int = 0,
        sequence_parallel: bool = False,
        pp_layers: list[int] | None = None,
        micro_batch_tokens: int | None = None,
        recompute: bool = False,
        offload_optimizer: bool = False,
        offload_base: bool = False,
    ):
        """`offload_optimizer` / `offload_base`: what `park` moves to host (the optimizer's state, the frozen
        base's weights) while the engines roll out."""
        from megatron_patches.lora import check_lora_replicas, lora_parameters
        from megatron_patches.model import build_policy

        self.device = torch.device(device)
        self.policy = build_policy(
            config,
            base_state,
            lora,
            dtype=dtype,
            device=device,
            seed=seed,
            sequence_parallel=sequence_parallel,
            pp_layers=None if pp_layers is None else list(pp_layers),
            recompute=recompute,
        )
        self.params = lora_parameters(self.policy)  # non-empty: load_run_inputs checked lora.targets
        check_lora_replicas(self.policy)  # ranks that replicate an adapter start from the same values
        self.loss_config, self.algo, self.temperature = loss, algo, temperature
        self.optimizer = torch.optim.AdamW(
            self.params, lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay, eps=1e-8
        )
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.grad_clip = optim.grad_clip
        # algo.routing_replay=rollout: every forward's routers take the engine's recorded experts (R3); a batch
        # whose samples carry routing is otherwise only measured against it (routing_agreement)
        self.replay = algo.routing_replay == "rollout"
        self.micro_batch_tokens = micro_batch_tokens
        self.offload_optimizer, self.offload_base = offload_optimizer, offload_base
        self._parked: Parked | None = None

    # ------------------------------------------------------------------ memory phases
    def park(self) -> None:
        """Move what `offload_optimizer` / `offload_base` name to host (the rollout phase: nothing here runs
        until `unpark`; the adapter itself stays, for the sync). Idempotent."""
        if self._parked is None:
            self._parked = Parked(self._parkable())

    def unpark(self) -> None:
        """Back on the device, bit for bit (the training phase, and before reading the optimizer's state)."""
        if self._parked is not None:
            self._parked.restore()
            self._parked = None

    def _parkable(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        if self.offload_base:
            trainable = {id(p) for p in self.params}
            out += [p for p in self.policy.parameters() if id(p) not in trainable]
            out += list(self.policy.buffers())
        if self.offload_optimizer:
            out += self._optimizer_tensors()
        return out

    def resident_bytes(self) -> int:
        """Bytes this rank's trainer holds now on its device (the policy's weights, LoRA and its gradients, the
        optimizer's state; allocator accounting of their storages)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        return resident_bytes([*self.policy.parameters(), *self.policy.buffers(), *grads, *self._optimizer_tensors()])

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state tensors (AdamW's moments; none before the first step)."""
        return [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]

    # ------------------------------------------------------------------ log-probs
    def _logprobs(self, hidden: torch.Tensor, micro, *, with_entropy: bool = False):
        """log pi(target | prefix) at temperature T for every response token of the micro-batch, [M] fp32 (and
        entropy [M]), from the last stage's hidden states [1, N, D]. Under context parallelism `hidden` holds
        this rank's tokens only: each rank computes its tokens' values and the CP group sums the [M] vectors
        (backward: every rank keeps the gradient of its own tokens, so the LoRA gradients summed over CP are
        the whole row's), so every CP rank computes the same loss."""
        from megatron_patches.vocab_parallel import token_logprobs

        packed, layout = micro.payload.packed, micro.layout
        if layout is None:
            return token_logprobs(
                self.policy, hidden[0, packed.positions], packed.targets, self.temperature, with_entropy=with_entropy
            )
        slot = torch.full((layout.padded,), -1, dtype=torch.long, device=hidden.device)
        slot[packed.positions] = torch.arange(len(packed.positions), device=hidden.device)
        mine = slot[layout.positions.to(hidden.device)]
        local = mine >= 0
        logp, entropy = token_logprobs(
            self.policy, hidden[0, local], packed.targets[mine[local]], self.temperature, with_entropy=with_entropy
        )
        where = (mine[local],)
        row = torch.zeros(len(packed.positions), dtype=logp.dtype, device=logp.device)
        logp = _sum_over_cp(row.index_put(where, logp))
        if entropy is not None:
            entropy = _sum_over_cp(torch.zeros_like(logp).index_put(where, entropy.detach())).detach()
        return logp, entropy

    def _media(self, pieces: list[Piece]):
        """Around a schedule call over `pieces`: their image features handed to the first stage's forwards
        (nothing for a text-only call, or on a later pipeline stage)."""
        feed = self.policy.media_feed
        if feed is None or all(p.packed.media is None for p in pieces):
            return contextlib.nullcontext()
        return feed.feeding([(p.packed.input_ids, p.packed.media) for p in pieces])

    def _forward_logprobs(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """Each piece's log-probs [M_i] without grad, on every rank (megatron's schedule, forward only)."""
        from megatron_patches.schedule import forward_only

        micros = [_micro(p, self.replay) for p in pieces]
        with self._media(pieces):
            outs = forward_only(self.policy, micros, lambda policy, hidden, mb: {"logp": self._logprobs(hidden, mb)[0]})
        return [o["logp"] for o in outs]

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The current policy's log-probs of each response token (no grad); for tests and diagnostics."""
        pieces = micro_batches(batch, self.micro_batch_tokens, self.device)
        out: list[list[float]] = []
        for piece, logp in zip(pieces, self._forward_logprobs(pieces)):
            padded = piece.packed.to_padded(logp).cpu()
            out += [padded[i, : len(r)].tolist() for i, r in enumerate(piece.batch.responses)]
        return out

    # ---------------------------------------------------------------------- train
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO update (algo.updates_per_step optimizer steps over group minibatches). Every rank gets
        the whole batch; a data-parallel rank trains on its share of each minibatch's groups, in micro-batches
        through megatron's schedule, each loss normalized by the whole minibatch's denominators, so the
        summed gradients are the whole minibatch's. Returns metrics of the whole batch averaged over the
        minibatches (the same on every rank), plus lr and grad_norm, and on CUDA train_peak_gib (the most
        memory any rank's process has held so far)."""
        from megatron_patches.lora import adapters_disabled, clip_lora_grad_norm_, reduce_lora_grads_
        from megatron_patches.schedule import forward_backward

        minibatches = batch.split_by_groups(self.algo.updates_per_step)
        plans = [
            even_out(micro_batches(share, self.micro_batch_tokens, self.device, weight), self.device)
            for share, weight in map(data_share, minibatches)
        ]
        old = None
        if len(plans) > 1:  # pi_old is the policy before this step's first update (eval mode: no dropout)
            self.policy.eval()
            with torch.no_grad():
                old = [self._forward_logprobs(pieces) for pieces in plans]
        self.policy.train()
        sums: dict[str, float] = {}
        routing_agree = routing_pairs = torch.zeros(self.policy.routing.width, dtype=torch.float64)
        for k, (mb, pieces) in enumerate(zip(minibatches, plans)):
            ref = None
            if self.loss_config.kl != "none":
                with torch.no_grad(), adapters_disabled(self.policy):
                    ref = self._forward_logprobs(pieces)
            total = Totals(mb.policy_tokens(), len(mb))  # loss-carrying tokens only (multi-turn masks)

            def loss_fn(policy, hidden, micro, old_k=old[k] if old is not None else None, ref_k=ref, total=total):
                return self._loss(hidden, micro, total, old_k, ref_k)

            self.optimizer.zero_grad(set_to_none=True)
            self.policy.routing.counts()  # the update's training forwards alone (not pi_old's, the reference's)
            with self._media(pieces):
                results = forward_backward(self.policy, [_micro(p, self.replay) for p in pieces], loss_fn)
            agree, pairs = self.policy.routing.counts()
            routing_agree, routing_pairs = routing_agree + agree, routing_pairs + pairs
            reduce_lora_grads_(self.policy)  # data-parallel (and expert-data) replicas: summed
            # the global norm over every rank's distinct gradients; grad_clip 0: measure, do not clip
            grad_norm = clip_lora_grad_norm_(self.policy, self.grad_clip or math.inf)
            self.optimizer.step()
            metrics = combine_metrics(results, [p.tokens for p in pieces], total.tokens)
            metrics["grad_norm"] = grad_norm
            for name, v in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(v) / len(plans)
        sums.update(routing_metrics(routing_agree, routing_pairs))
        sums["lr"] = self.scheduler.get_last_lr()[0]  # the rate this step used
        if self.device.type == "cuda":  # the largest of the ranks' peaks (the colocated engine's pools included)
            peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**30], device=self.device)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            sums["train_peak_gib"] = float(peak)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # the gradients are not needed until the next update's backward
        self.policy.eval()
        return sums

    def _loss(
        self, hidden: torch.Tensor, micro, total: Totals, old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's GRPO loss (normalized by the minibatch's `total`) and its metrics (last stage)."""
        piece = micro.payload
        p, share = piece.packed, piece.batch
        logp, entropy = self._logprobs(hidden, micro, with_entropy=True)
        old_logp = p.to_padded(old[piece.index] if old is not None else logp.detach())
        ref_logp = p.to_padded(ref[piece.index]) if ref is not None else None
        rollout = p.to_padded(
            torch.tensor([x for lp in share.rollout_logprobs for x in lp], dtype=torch.float32, device=self.device)
        )
        adv = torch.tensor(share.advantages, dtype=torch.float32, device=self.device)
        loss, metrics = policy_loss(
            p.to_padded(logp),
            old_logp,
            adv,
            p.mask(),
            self.loss_config,
            ref_logp=ref_logp,
            rollout_logp=rollout,
            num_tokens=total.tokens,
            num_sequences=total.sequences,
        )
        metrics["entropy"] = entropy[p.loss_mask].mean()  # over the tokens the loss counts
        if piece.weight != 1.0:  # a stand-in (`data_share`): the collectives run, nothing is added
            loss, metrics = loss * piece.weight, {k: v * piece.weight for k, v in metrics.items()}
        return loss, metrics

    # ------------------------------------------------------------ adapter / state
    def adapter_state(self) -> dict[str, torch.Tensor]:
        from megatron_patches.lora import adapter_state

        return adapter_state(self.policy)

    def adapter_shards(self) -> dict[str, tuple[torch.Tensor, tuple[tuple[int, int], ...]]]:
        """This rank's own adapter blocks and their boxes in the full tensors (`megatron_patches.lora.adapter_shards`:
        nothing gathered)."""
        from megatron_patches.lora import adapter_shards

        return adapter_shards(self.policy)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed rank needs besides the adapter (saved in PEFT form by the driver); the optimizer's
        tensors copied to the host (the live ones may be parked on it, `park`, once this returns)."""
        return {
            "optimizer": _to_host(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(self.device),
            "lora_dropout_rng": self.policy.lora_generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any], adapter: dict[str, torch.Tensor]) -> None:
        from megatron_patches.lora import check_lora_replicas, load_adapter_state

        load_adapter_state(self.policy, adapter)
        check_lora_replicas(self.policy)
        # fresh storages (a loaded checkpoint's may not be resizable, and parking resizes them)
        self.optimizer.load_state_dict(_to_host(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.device)
        self.policy.lora_generator.set_state(state["lora_dropout_rng"])


def _to_host(obj: Any) -> Any:
    """`obj` with every tensor inside its dicts and lists replaced by a host copy."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


class Totals(NamedTuple):
    """The whole minibatch's loss denominators (over every data-parallel rank and micro-batch)."""

    tokens: int  # response tokens that carry loss (a multi-turn sample's environment tokens are not counted)
    sequences: int


def _sum_over_cp(x: torch.Tensor) -> torch.Tensor:
    """Sum over the context-parallel group, forward; identity backward (megatron's all-reduce mapping, on the CP
    group): each rank's part of the sum gets the gradient of the whole."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=ps.get_context_parallel_group())


def _micro(piece: Piece, replay: bool = False):
    """The schedule's micro-batch of a piece: its packed row, and the engine's routing when recorded (replayed
    with `replay`, else only compared against)."""
    from megatron_patches.schedule import MicroBatch

    return MicroBatch(
        piece.packed.input_ids, piece.packed.cu_seqlens, payload=piece, routing=piece.packed.routing, replay=replay
    )


def routing_metrics(agree: torch.Tensor, pairs: torch.Tensor) -> dict[str, float]:
    """routing_agreement (over every recorded token-expert pair of the update's training forwards, summed over
    the ranks) and routing_agreement_min_layer (its worst MoE layer); empty when nothing was recorded. Every
    rank calls it (a pipeline stage of dense layers counts nothing but joins the sum)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # each rank counted its tokens and its layers
        both = for_group(torch.stack([agree, pairs]), None)
        dist.all_reduce(both)
        agree, pairs = both.cpu()
    if not float(pairs.sum()):
        return {}
    seen = pairs > 0
    return {
        "routing_agreement": float(agree.sum() / pairs.sum()),
        "routing_agreement_min_layer": float((agree[seen] / pairs[seen]).min()),
    }


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
