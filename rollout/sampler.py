"""Token sampling: temperature, top-k, top-p, per-request seeds; log-probs from the untruncated distribution."""

from __future__ import annotations

import torch

from rollout.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
           ) -> tuple[list[int], list[float]]:
    """logits [B, V] -> (token per row, log-prob of that token under softmax(logits / temperature)).

    Truncation (top-k, top-p) only shapes what can be drawn; the reported log-prob is the untruncated one,
    which is what importance correction against the trainer needs. Greedy rows (temperature 0) report the
    temperature-1 log-prob.
    """
    tokens, logps = [], []
    for row, p, gen in zip(logits.float(), params, generators):
        temp = p.temperature if p.temperature > 0 else 1.0
        logprobs = torch.log_softmax(row / temp, dim=-1)
        if p.temperature == 0:
            tok = int(row.argmax())
        else:
            tok = _draw(logprobs, p, gen)
        tokens.append(tok)
        logps.append(float(logprobs[tok]))
    return tokens, logps


def _draw(logprobs: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    probs = logprobs.exp()
    if p.top_k and p.top_k < probs.numel():
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays in)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p * sorted_p.sum()
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
