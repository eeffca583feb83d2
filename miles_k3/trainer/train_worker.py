"""The trainer side of the colocated loop: the megatron-core policy (frozen BF16 base + LoRA), its optimizer,
and one GRPO update per call.

Every rank of a tensor-parallel group holds one TrainWorker and calls `train` with the same batch (megatron's
parallel linears do the communication). `adapter_state()` returns full (TP-gathered) adapter tensors in the
engine's naming; `state_dict()` / `load_state_dict()` carry adapters, optimizer, LR schedule and RNG states for
checkpoints.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from miles_k3.algo import policy_loss
from miles_k3.model.config import K3Config
from miles_k3.trainer.batch import Packed, TrainBatch, pack


class TrainWorker:
    def __init__(self, config: K3Config, base_state: dict[str, torch.Tensor], lora, *, loss, algo, optim,
                 temperature: float, dtype: torch.dtype, device: str, seed: int = 0,
                 sequence_parallel: bool = False):
        from megatron_patches.lora import lora_parameters
        from megatron_patches.model import build_policy

        self.device = torch.device(device)
        self.policy = build_policy(config, base_state, lora, dtype=dtype, device=device, seed=seed,
                                   sequence_parallel=sequence_parallel)
        self.params = lora_parameters(self.policy)  # non-empty: load_run_inputs checked lora.targets
        self.loss_config, self.algo, self.temperature = loss, algo, temperature
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                           weight_decay=optim.weight_decay, eps=1e-8)
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.grad_clip = optim.grad_clip

    # ------------------------------------------------------------------ log-probs
    def _token_logprobs(self, packed: Packed, *, with_entropy: bool = False):
        """log pi(target | prefix) at temperature T for every response token, [M] fp32 (and entropy [M])."""
        from megatron_patches.vocab_parallel import token_logprobs

        hidden = self.policy.model(packed.input_ids, cu_seqlens=packed.cu_seqlens)[0, packed.positions]
        return token_logprobs(self.policy, hidden, packed.targets, self.temperature, with_entropy=with_entropy)

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The current policy's log-probs of each response token (no grad); for tests and diagnostics."""
        packed = pack(batch, self.device)
        with torch.no_grad():
            logp, _ = self._token_logprobs(packed)
        padded = packed.to_padded(logp).cpu()
        return [padded[i, :len(r)].tolist() for i, r in enumerate(batch.responses)]

    # ---------------------------------------------------------------------- train
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO update (algo.updates_per_step optimizer steps over group minibatches). Every rank gets
        the whole batch; a data-parallel rank trains on its share of each minibatch's groups, with the loss
        normalized by the whole minibatch's denominators so the summed gradients are the whole batch's.
        Returns metrics of the whole batch averaged over the minibatches (the same on every rank), plus lr
        and grad_norm."""
        from megatron_patches.lora import adapters_disabled, clip_lora_grad_norm_, reduce_lora_grads_

        minibatches = batch.split_by_groups(self.algo.updates_per_step)
        shares = [data_share(mb) for mb in minibatches]
        packed = [pack(share, self.device) for share in shares]
        old = None
        if len(packed) > 1:  # pi_old is the policy before this step's first update (eval mode: no dropout)
            self.policy.eval()
            with torch.no_grad():
                old = [self._token_logprobs(p)[0] for p in packed]
        self.policy.train()
        sums: dict[str, float] = {}
        for k, (mb, share, p) in enumerate(zip(minibatches, shares, packed)):
            ref = None
            if self.loss_config.kl != "none":
                with torch.no_grad(), adapters_disabled(self.policy):
                    ref = p.to_padded(self._token_logprobs(p)[0])
            logp, entropy = self._token_logprobs(p, with_entropy=True)
            mask = p.mask()
            old_logp = p.to_padded(old[k] if old is not None else logp.detach())
            rollout = p.to_padded(torch.tensor([x for lp in share.rollout_logprobs for x in lp],
                                               dtype=torch.float32, device=self.device))
            adv = torch.tensor(share.advantages, dtype=torch.float32, device=self.device)
            num_tokens = sum(len(r) for r in mb.responses)
            loss, metrics = policy_loss(p.to_padded(logp), old_logp, adv, mask, self.loss_config, ref_logp=ref,
                                        rollout_logp=rollout, num_tokens=num_tokens, num_sequences=len(mb))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            reduce_lora_grads_(self.policy)  # data-parallel (and expert-data) replicas: summed
            # the global norm over every rank's distinct gradients; grad_clip 0: measure, do not clip
            grad_norm = clip_lora_grad_norm_(self.policy, self.grad_clip or math.inf)
            self.optimizer.step()
            metrics["entropy"] = entropy.mean()
            metrics = whole_batch_metrics(metrics, int(mask.sum()), num_tokens)
            metrics["grad_norm"] = grad_norm
            for name, v in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(v) / len(packed)
        sums["lr"] = self.scheduler.get_last_lr()[0]  # the rate this step used
        self.scheduler.step()
        self.policy.eval()
        return sums

    # ------------------------------------------------------------ adapter / state
    def adapter_state(self) -> dict[str, torch.Tensor]:
        from megatron_patches.lora import adapter_state

        return adapter_state(self.policy)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed rank needs besides the adapter (saved in PEFT form by the driver)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(self.device), "lora_dropout_rng": self.policy.lora_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any], adapter: dict[str, torch.Tensor]) -> None:
        from megatron_patches.lora import load_adapter_state

        load_adapter_state(self.policy, adapter)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], self.device)
        self.policy.lora_generator.set_state(state["lora_dropout_rng"])


# Metrics that are sums over the whole batch once each rank's loss is normalized by the batch's denominators;
# every other metric is a per-token mean, combined over data-parallel ranks weighted by their token counts.
_SUMMED = ("loss", "pg_loss", "kl_loss")


def data_share(batch: TrainBatch) -> TrainBatch:
    """This data-parallel rank's whole groups of `batch` (all of it without data parallelism)."""
    from megatron.core import parallel_state as ps

    size = ps.get_data_parallel_world_size()
    return batch if size == 1 else batch.split_by_groups(size)[ps.get_data_parallel_rank()]


def whole_batch_metrics(metrics: dict[str, torch.Tensor], tokens: int, total_tokens: int) -> dict[str, torch.Tensor]:
    """One rank's metrics of its share (`tokens` of the minibatch's `total_tokens` response tokens) -> the whole
    minibatch's, the same on every data-parallel rank: loss terms summed, per-token means weighted by the
    ranks' token counts (exact for token means; a sequence-level statistic such as rollout_ess becomes the
    token-weighted mean of the ranks' values)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() == 1:
        return metrics
    names = sorted(metrics)
    weight = tokens / total_tokens
    flat = torch.stack([metrics[n].detach().double() * (1.0 if n in _SUMMED else weight) for n in names])
    dist.all_reduce(flat, group=ps.get_data_parallel_group())
    return dict(zip(names, flat.float()))


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

