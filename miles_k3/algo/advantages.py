"""Group-normalized (GRPO) advantages from scalar rewards.

For sample i of group g with rewards r_g = {r_g1 .. r_gn}:

    A_i = (r_i - mean(r_g)) / (std(r_g) + eps)     normalize_std=True  (GRPO, DeepSeekMath)
    A_i =  r_i - mean(r_g)                         normalize_std=False (Dr.GRPO, arXiv 2503.20783)

std is the *population* standard deviation, sqrt(mean((r - mean)^2)) (ddof 0),
not Bessel's unbiased one. Why: we normalize within the group we have, not
estimate a wider population's spread; with ddof 0 the advantages of a group
have unit RMS (sum A^2 = n, up to eps) whatever n is, and a group of one is
well defined (A = 0) instead of 0/0. TRL and verl use ddof 1, whose std is
ours times sqrt(n / (n - 1)), so their advantages are ours times
sqrt((n - 1) / n) (for n = 8: 0.935).

A group whose rewards are all equal carries no learning signal: its advantages
are exactly 0 (set explicitly: the float mean of equal values is not always
bit-equal to them, and dividing that residue by eps would blow it up).

Groups may be ragged (a failed reward plugin drops a sample from its group):
pass `group_ids` instead of a fixed `group_size`.
"""

from __future__ import annotations

import torch

from miles_k3.algo.reducers import as_bool_mask

__all__ = ["group_ids_for", "group_advantages", "expand_to_tokens"]


def group_ids_for(
    rewards: torch.Tensor, group_size: int | None = None, group_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flatten rewards and name each sample's group.

    Accepts rewards [G, n] (neither argument), [G*n] with `group_size`, or [N]
    with `group_ids` [N] (ints in [0, G)). Returns (rewards_flat [N] float,
    ids [N] int64, G). ValueError on a shape or argument mismatch and on
    non-finite rewards (a NaN reward must never turn into a silent advantage).
    """
    if rewards.dim() == 2:
        if group_size is not None or group_ids is not None:
            raise ValueError("rewards [G, n] already name their groups; pass neither group_size nor group_ids")
        num_groups, n = rewards.shape
        ids = torch.arange(num_groups, device=rewards.device).repeat_interleave(n)
    elif rewards.dim() == 1:
        if (group_size is None) == (group_ids is None):
            raise ValueError("rewards [N] need exactly one of group_size or group_ids")
        if group_size is not None:
            if group_size <= 0 or rewards.numel() % group_size != 0:
                raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
            num_groups = rewards.numel() // group_size
            ids = torch.arange(num_groups, device=rewards.device).repeat_interleave(group_size)
        else:
            if group_ids.shape != rewards.shape:
                raise ValueError(f"group_ids {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}")
            ids = group_ids.long()
            if ids.numel() and int(ids.min()) < 0:
                raise ValueError("group_ids must be >= 0")
            num_groups = int(ids.max()) + 1 if ids.numel() else 0
    else:
        raise ValueError(f"rewards must be [G, n] or [N], got {tuple(rewards.shape)}")
    flat = rewards.reshape(-1)
    if not flat.is_floating_point() or flat.element_size() < 4:  # ints, bools, fp16/bf16 -> fp32
        flat = flat.float()
    if not torch.isfinite(flat).all():
        raise ValueError("rewards contain NaN or inf; drop or fail those samples before computing advantages")
    return flat, ids, num_groups


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    group_ids: torch.Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample GRPO advantages, same shape as `rewards` (fp32, or fp64 for fp64 input).

    See the module docstring for the formula and the std estimator.
    """
    flat, ids, num_groups = group_ids_for(rewards, group_size, group_ids)
    zeros = torch.zeros(num_groups, dtype=flat.dtype, device=flat.device)
    counts = zeros.index_add(0, ids, torch.ones_like(flat))
    mean = zeros.index_add(0, ids, flat) / counts.clamp_min(1)
    centered = flat - mean[ids]
    adv = centered
    if normalize_std:
        var = zeros.index_add(0, ids, centered * centered) / counts.clamp_min(1)
        adv = centered / (var.sqrt()[ids] + eps)
    # Zero-variance groups: exact max == min test, immune to the mean's rounding.
    gmax = zeros.scatter_reduce(0, ids, flat, "amax", include_self=False)
    gmin = zeros.scatter_reduce(0, ids, flat, "amin", include_self=False)
    adv = torch.where((gmax == gmin)[ids], torch.zeros_like(adv), adv)
    return adv.reshape(rewards.shape)


def expand_to_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages [B] -> per-token [B, T] (0 off the mask); [B, T] passes through masked."""
    if advantages.dim() == 1:
        if advantages.shape[0] != loss_mask.shape[0]:
            raise ValueError(f"advantages [B={advantages.shape[0]}] do not match loss_mask {tuple(loss_mask.shape)}")
        advantages = advantages[:, None].expand(loss_mask.shape)
    elif advantages.shape != loss_mask.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] or match loss_mask {tuple(loss_mask.shape)}"
        )
    return torch.where(
        as_bool_mask(loss_mask), advantages, torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    )
