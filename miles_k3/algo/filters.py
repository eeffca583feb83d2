"""Dynamic sampling (DAPO, arXiv 2503.14476): keep only groups that carry a learning signal.

A group whose n rewards are all equal (all solved, or all failed) has zero
group-normalized advantage for every sample, so its only effect on a batch
would be to dilute the token-mean of the others. DAPO drops such groups and
keeps sampling prompts until the batch holds the target number of groups.

    keep_g = max(r_g) > min(r_g)          (exact: zero variance <=> all rewards equal)
    missing = max(0, target - kept)
    to_sample = ceil(missing / keep_rate)  (with the observed fraction of groups kept)
"""

from __future__ import annotations

import math

import torch

from miles_k3.algo.advantages import group_ids_for

__all__ = ["nonzero_variance_groups", "groups_to_refill"]


def nonzero_variance_groups(
    rewards: torch.Tensor, group_size: int | None = None, *, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep-mask [G] bool: True for groups whose rewards are not all equal.

    rewards [G, n], or [G*n] with `group_size`, or [N] with `group_ids` (see
    `advantages.group_ids_for`). Empty ids in a ragged layout are not kept.
    Expand to samples with `keep[ids]`.
    """
    flat, ids, num_groups = group_ids_for(rewards, group_size, group_ids)
    init = torch.zeros(num_groups, dtype=flat.dtype, device=flat.device)
    gmax = init.scatter_reduce(0, ids, flat, "amax", include_self=False)
    gmin = init.scatter_reduce(0, ids, flat, "amin", include_self=False)
    return gmax > gmin


def groups_to_refill(num_kept: int, target_groups: int, keep_rate: float = 1.0) -> int:
    """How many more groups to sample so the batch reaches `target_groups` kept groups.

    ceil(max(0, target - kept) / keep_rate). With keep_rate = 1 (default) this is
    just the shortfall; pass the fraction of groups kept so far to oversample.
    ValueError for a keep_rate outside (0, 1] (0 would mean: no prompt ever
    helps, which the caller must handle, not loop on).
    """
    if num_kept < 0 or target_groups < 0:
        raise ValueError(f"num_kept and target_groups must be >= 0, got {num_kept}, {target_groups}")
    if not 0.0 < keep_rate <= 1.0:
        raise ValueError(f"keep_rate must be in (0, 1], got {keep_rate}")
    missing = max(0, target_groups - num_kept)
    # Round before ceil so that e.g. 3 / 0.3 = 10.000000000000002 asks for 10, not 11.
    return math.ceil(round(missing / keep_rate, 9))
