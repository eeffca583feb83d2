"""Greedy generation with the reference model: the oracle the rollout engine's greedy output must equal."""

from __future__ import annotations

import torch

from miles_k3.model.cache import DenseStateCache
from miles_k3.model.modeling import K3ForCausalLM, MediaEmbeds


@torch.no_grad()
def greedy_generate(
    model: K3ForCausalLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    media: MediaEmbeds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt_ids [B, T] (equal lengths) -> (new tokens [B, N], log-probs of those tokens [B, N] fp32).

    One prefill (with `media`'s image features at their pad positions of the flattened prompts), then one
    token per step through `DenseStateCache`. A row that emitted `eos_token_id` keeps emitting it (N stays
    common to the batch); N == max_new_tokens unless every row stopped earlier.
    """
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty [B, T] tensor, got shape {tuple(prompt_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = DenseStateCache(model.config)
    logits = model(prompt_ids, cache, media=media).logits[:, -1]
    tokens, logps = [], []
    done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    for _ in range(max_new_tokens):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        nxt = logprobs.argmax(-1)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
        tokens.append(nxt)
        logps.append(logprobs.gather(-1, nxt[:, None])[:, 0])
        if eos_token_id is not None:
            done |= nxt == eos_token_id
            if bool(done.all()):
                break
        logits = model(nxt[:, None], cache).logits[:, -1]
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)
