"""One rank of the expert- and data-parallel tests (spawned, gloo on CPU); `run_case` also runs in-process as
the single-process reference.

Every case holds one union batch of two rows; rank r of a two-rank world trains on row r (its own tokens),
the reference on both. The loss is normalized by the union's token count on every rank (as the trainer
normalizes by the global batch), so the gradients summed over ranks are the reference's. No LoRA dropout:
data-parallel ranks draw masks over their own rows, which cannot equal the masks of the union.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from megatron_patches.lora import (
    adapter_grads,
    adapter_state,
    check_lora_replicas,
    clip_lora_grad_norm_,
    load_adapter_state,
    lora_modules,
    reduce_lora_grads_,
)
from megatron_patches.model import build_policy, reference_state
from miles_k3.model import K3Config
from miles_k3.model.lora_spec import LoraSpec
from tests.megatron_patches.common import layout, spawned_rank

SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0)
DTYPE = torch.float64
ROWS, LENGTH = 2, 12
_HELD = re.compile(r"^model\.layers\.1\.block_sparse_moe\.experts\.(\d+)\.w1\.weight$")


def configs() -> dict[str, K3Config]:
    tiny = K3Config.from_preset("k3-tiny")
    return {"k3-tiny": tiny, "kimi-linear-form": tiny.kimi_linear_form()}


def cases() -> dict[str, tuple[K3Config, bool]]:
    """name -> (config, skewed). Skewed: every token's experts are among the first half, so under EP=2
    rank 1's experts receive no rows at all."""
    return {f"{name}{'/skewed' if skew else ''}": (c, skew) for name, c in configs().items() for skew in (False, True)}


def base_state(config: K3Config, skewed: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    state = reference_state(config, seed)
    if skewed:  # the correction bias picks experts, it does not weight them
        for name, t in state.items():
            if name.endswith("gate.e_score_correction_bias"):
                state[name] = t.clone()
                state[name][: config.num_experts // 2] += 100.0
    return state


def run_case(config: K3Config, skewed: bool, rows: slice = slice(0, ROWS), reduce: bool = True, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, config.vocab_size, (ROWS, LENGTH), generator=g)
    targets = torch.randint(3, config.vocab_size, (ROWS, LENGTH), generator=g)
    policy = build_policy(config, base_state(config, skewed, seed), SPEC, seed=seed, dtype=DTYPE)
    gen = torch.Generator().manual_seed(seed + 2)  # the same full adapter on every rank
    load_adapter_state(
        policy, {k: torch.randn(v.shape, generator=gen, dtype=DTYPE) * 0.3 for k, v in adapter_state(policy).items()}
    )
    routed = []  # the largest expert index any token chose, per MoE layer
    for m in policy.modules():
        if type(m).__name__ == "Router":
            m.register_forward_hook(lambda mod, args, out: routed.append(int(out[1].max())))
    logits = policy(ids[rows]).logits
    loss = (
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1), reduction="sum") / ids.numel()
    )
    loss.backward()
    before = adapter_grads(policy)
    if reduce:
        reduce_lora_grads_(policy)
    grads = adapter_grads(policy)
    norm = clip_lora_grad_norm_(policy, max_norm=1e-3)
    return {
        "loss": loss.detach(),
        "before": before,
        "grads": grads,
        "norm": norm,
        "clipped": adapter_grads(policy),
        "export": adapter_state(policy),
        "max_routed": max(routed),
        "held": sorted(int(m[1]) for k in policy.state_dict() if (m := _HELD.match(k))),
    }


def run_replica_checks(rank: int) -> dict:
    """DP=2: a fresh build passes `check_lora_replicas`; one rank's perturbed factor is named; a factor
    with a gradient on one rank only gets the sum, one with none anywhere stays None."""
    config = configs()["k3-tiny"]
    policy = build_policy(config, reference_state(config), SPEC, dtype=DTYPE)
    out = {}
    check_lora_replicas(policy)
    mods = lora_modules(policy)
    dense, expert = next(m for m in mods if not m.expert), next(m for m in mods if m.expert)
    with torch.no_grad():
        if rank == 1:
            expert.A[0, 0, 0] += 1e-12
    try:
        check_lora_replicas(policy)
        out["perturbed"] = None
    except ValueError as e:
        out["perturbed"] = str(e)
    for p in policy.parameters():
        p.grad = None
    dense.A.grad = torch.full_like(dense.A, float(rank + 1)) if rank == 0 else None
    expert.B.grad = torch.full_like(expert.B, 2.0 + rank)
    reduce_lora_grads_(policy)
    out["one_rank"] = dense.A.grad.clone()
    out["both"] = expert.B.grad.clone()
    out["none_anywhere"] = dense.B.grad is None and expert.A.grad is None
    return out


def worker(rank: int, world: int, port: int, out: str, which: str, watchdog_s: float = 300.0) -> None:
    """which: "ep" (EP=2 and DP=2 cases, both forms) or "reduction" (DP=2 without the reduction, replica
    checks). A rank stuck in a collective past `watchdog_s` dumps its stacks and exits."""
    mine = slice(rank, rank + 1)
    results = {}
    with spawned_rank(rank, world, port, watchdog_s):
        if which == "ep":
            with layout(ep=world):
                results |= {f"ep/{name}": run_case(c, skew, mine) for name, (c, skew) in cases().items()}
            with layout():
                results |= {f"dp/{name}": run_case(c, False, mine) for name, c in configs().items()}
        else:
            with layout():
                results["unreduced"] = run_case(configs()["k3-tiny"], False, mine, reduce=False)
                results["replicas"] = run_replica_checks(rank)
    torch.save(results, f"{out}/rank{rank}.pt")
