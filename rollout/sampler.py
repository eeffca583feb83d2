"""Token sampling for a whole batch at once: temperature, top-k, top-p, per-request seeds, exact log-probs.

The batch is sampled with a fixed number of kernels (plus one noise draw per sampled row); `sample_on_device`
enqueues it without waiting for the device, `sample` adds the one device-to-host copy.
"""

from __future__ import annotations

import torch

from rollout.request import SamplingParams
from rollout.transfer import to_device


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
           ) -> tuple[list[int], list[float]]:
    """logits [B, V] -> (token per row, log-prob of that token under softmax(logits / temperature)).

    Truncation (top-k, top-p) only shapes what can be drawn; the reported log-prob is the untruncated one,
    which is what importance correction against the trainer needs. Greedy rows (temperature 0) take the
    first argmax of the logits and report the temperature-1 log-prob.

    A sampled row draws with the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with
    probability p_i / sum(p), so truncation is just zeroing p. Row b's noise comes from `generators[b]`, one
    [V] draw per seeded row, so a seeded request's draws depend only on its own seed and step count: a prefix
    hit or a retraction cannot change its samples. Rows without a generator share one draw from the global
    generator (one kernel for all of them, however large the batch).
    """
    tokens, logps = sample_on_device(logits, params, generators)
    both = torch.stack([tokens.to(torch.float64), logps.to(torch.float64)]).tolist()  # the one sync
    return [int(t) for t in both[0]], both[1]


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """As `sample`, but returns device tensors (tokens [B] int64, log-probs [B] fp32) without syncing."""
    b = logits.shape[0]
    device = logits.device
    logits = logits.float()
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if all(t == 1.0 for t in temps):
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        logprobs = torch.log_softmax(logits / to_device(temps, device)[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        rows = drawn if len(drawn) < b else slice(None)
        probs = logprobs[rows].exp()
        probs = truncate_probs(probs, [params[i] for i in drawn])
        noise = torch.empty_like(probs)
        seeded = [(j, generators[i]) for j, i in enumerate(drawn) if generators[i] is not None]
        if len(seeded) < len(drawn):  # rows without a generator: one draw from the global one for all rows
            noise.exponential_()
        for j, generator in seeded:  # then each seeded row's own draw over its row
            noise[j].exponential_(generator=generator)
        choice = (probs / noise).argmax(dim=-1)
        if isinstance(rows, slice):
            tokens = choice
        else:
            tokens = tokens.index_copy(0, to_device(drawn, device), choice)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def truncate_probs(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero what top-k (keep values >= the k-th largest, ties included) and then top-p (keep the smallest
    prefix of the top-k-truncated distribution whose mass reaches top_p; the crossing token stays) exclude."""
    vocab = probs.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return probs
    device = probs.device
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if any(top_k):
        k = to_device([k if k else vocab for k in top_k], device)
        kth = sorted_p.gather(1, (k - 1)[:, None])
        # ties with the k-th value sit right after it in sorted order, so the kept set is a sorted prefix
        sorted_p = torch.where(sorted_p >= kth, sorted_p, torch.zeros_like(sorted_p))
    if any(p < 1.0 for p in top_p):
        limit = to_device(top_p, device, sorted_p.dtype)[:, None] * sorted_p.sum(-1, keepdim=True)
        sorted_p = torch.where(sorted_p.cumsum(-1) - sorted_p < limit, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter(1, order, sorted_p)
