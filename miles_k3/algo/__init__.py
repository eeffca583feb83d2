"""GRPO-family algorithms as small pure functions (torch tensors in, tensors out).

Conventions everywhere: per-token tensors are [B, T] over response positions,
log-probs fp32, `loss_mask` [B, T] bool (or 0/1) marks the tokens that carry
loss; masked positions are selected out, so padding may hold anything.

    advantages          group-normalized (GRPO / Dr.GRPO) advantages
    policy_loss         token / GSPO ratios, clipped surrogate (clip-higher, dual-clip)
    kl                  k1 / k2 / k3 against the base policy
    reducers            token-mean, sequence-mean, Dr.GRPO
    rollout_correction  TIS, MIS, OPSM against the engine's log-probs; ESS
    filters             DAPO dynamic sampling (zero-variance groups) and refill count
    metrics             clipfrac, approx KL, chunked entropy, log-prob diff, reward stats
    loss                PolicyLossConfig + policy_loss, the composed entry point
"""

from miles_k3.algo.advantages import expand_to_tokens, group_advantages, group_ids_for
from miles_k3.algo.filters import groups_to_refill, nonzero_variance_groups
from miles_k3.algo.kl import KL_ESTIMATORS, kl_penalty
from miles_k3.algo.loss import KL_TYPES, RATIO_TYPES, ROLLOUT_CORRECTIONS, PolicyLossConfig, policy_loss
from miles_k3.algo.metrics import approx_kl, entropy_from_logits, logprob_abs_diff, pg_clipfrac, reward_stats
from miles_k3.algo.policy_loss import ClipResult, clipped_surrogate, gspo_log_ratio, token_log_ratio
from miles_k3.algo.reducers import (
    REDUCERS,
    as_bool_mask,
    dr_grpo_mean,
    masked_mean,
    masked_sum,
    reduce_loss,
    sequence_mean,
    token_mean,
)
from miles_k3.algo.rollout_correction import (
    MIS_LEVELS,
    MISResult,
    OPSMResult,
    effective_sample_size,
    mis_weights,
    opsm_mask,
    rollout_log_ratio,
    tis_weights,
)

__all__ = [
    # advantages
    "group_advantages",
    "group_ids_for",
    "expand_to_tokens",
    # ratios and surrogate
    "token_log_ratio",
    "gspo_log_ratio",
    "clipped_surrogate",
    "ClipResult",
    # KL
    "KL_ESTIMATORS",
    "kl_penalty",
    # reducers
    "REDUCERS",
    "reduce_loss",
    "token_mean",
    "sequence_mean",
    "dr_grpo_mean",
    "masked_sum",
    "masked_mean",
    "as_bool_mask",
    # rollout correction
    "MIS_LEVELS",
    "tis_weights",
    "mis_weights",
    "MISResult",
    "opsm_mask",
    "OPSMResult",
    "rollout_log_ratio",
    "effective_sample_size",
    # dynamic sampling
    "nonzero_variance_groups",
    "groups_to_refill",
    # metrics
    "pg_clipfrac",
    "approx_kl",
    "entropy_from_logits",
    "logprob_abs_diff",
    "reward_stats",
    # composed loss
    "PolicyLossConfig",
    "policy_loss",
    "RATIO_TYPES",
    "KL_TYPES",
    "ROLLOUT_CORRECTIONS",
]
