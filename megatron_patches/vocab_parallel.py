"""Token log-probs and entropy of the policy's next-token distribution, for the trainer's loss.

    logp, entropy = token_logprobs(policy, hidden, targets, temperature, with_entropy=True)

hidden [M, D] are the final-normed hidden states that predict `targets` [M]; logp [M] fp32 carries the
gradient, entropy [M] fp32 is detached (a metric).

Today the lm_head gathers the full vocabulary on every TP rank and this is the plain computation.
Being built (issue 13 part 5): vocab-parallel logits (each TP rank its vocab slice) with the log-softmax and
entropy reduced over the TP group and chunked over tokens, so no rank holds [M, V].
"""

from __future__ import annotations

import torch

from miles_k3.algo import entropy_from_logits


def token_logprobs(policy, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, *,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = policy.logits(hidden).float() / temperature
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        return logp, entropy_from_logits(logits.detach())
