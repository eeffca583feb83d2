"""Token sampling for a whole batch at once: temperature, top-k, top-p, per-request noise, exact log-probs.

Every row draws from its own counter-based noise (`rollout.noise`: a function of the request's seed and the
position of the token it draws), so the batch is sampled with a fixed number of kernels whatever its size:
two on CUDA (`rollout.kernels.sampling`, for the rows without truncation), a few dozen torch ops elsewhere.
`sample_on_device` enqueues without waiting for the device; `sample` adds the one device-to-host copy.
"""

from __future__ import annotations

import torch

from miles_k3 import kernels
from rollout import noise
from rollout.request import SamplingParams
from rollout.transfer import to_device


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> tuple[list[int], list[float]]:
    """logits [B, V] -> (token per row, log-prob of that token under softmax(logits / temperature)).

    Truncation (top-k, top-p) only shapes what can be drawn; the reported log-prob is the untruncated one,
    which is what importance correction against the trainer needs. Greedy rows (temperature 0) take the
    first argmax of the logits and report the temperature-1 log-prob.

    A sampled row draws with the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with
    probability p_i / sum(p), so truncation is just zeroing p. Row b's E is
    `rollout.noise.exponentials(seeds[b], positions[b])`: the same draw for the same request and position
    whatever else is in the batch, so a prefix hit, a retraction or the schedule cannot change its samples.
    """
    tokens, logps = sample_on_device(logits, params, seeds, positions)
    both = torch.stack([tokens.to(torch.float64), logps.to(torch.float64)]).tolist()  # the one sync
    return [int(t) for t in both[0]], both[1]


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `sample`, but returns device tensors (tokens [B] int64, log-probs [B] fp32) without syncing."""
    return sample_keys(logits, params, to_device([seeds, positions], logits.device, torch.long))


def sample_keys(
    logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_on_device` with each row's (seed, position) as a [2, B] int64 tensor on the logits' device
    (positions the device computed: a speculative step's)."""
    tokens, logps, _ = sample_alternatives(logits, params, keys)
    return tokens, logps


def sample_alternatives(
    logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`sample_keys`, plus the alternatives of the rows whose params ask for them (`SamplingParams.alternatives`),
    taken from the log-softmax the sampled token's log-prob is read from (one pass, no second forward): a
    device tensor laid out by `alternatives` over those rows (in row order), None when no row asks."""
    asking = [i for i, p in enumerate(params) if p.alternatives]
    with torch.inference_mode():
        if not kernels.use_kernels(logits):
            tokens, logps, logprobs = _draw_torch(logits, params, keys, keep=bool(asking))
            if not asking:
                return tokens, logps, None
            rows = asking if len(asking) < len(params) else slice(None)
            return tokens, logps, alternatives(logprobs[rows], [params[i] for i in asking])
        from rollout.kernels.sampling import sample_rows  # triton: CUDA builds and the interpreter only

        vocab = logits.shape[-1]
        # the kernel draws without truncation and reports only the sampled token: truncated rows, and rows
        # asking for alternatives (their top log-probs must come from the very log-softmax their token's
        # log-prob does), take the torch path
        torch_rows = [i for i, p in enumerate(params) if (p.temperature > 0 and _truncates(p, vocab)) or p.alternatives]
        temps = to_device([p.temperature for p in params], logits.device, torch.float32)
        tokens, logps = sample_rows(logits, temps, keys)
        alt = None
        if torch_rows:
            rows = to_device(torch_rows, logits.device, torch.long)
            sub = [params[i] for i in torch_rows]
            t, lp, logprobs = _draw_torch(logits[rows], sub, keys[:, rows], keep=bool(asking))
            tokens, logps = tokens.index_copy(0, rows, t), logps.index_copy(0, rows, lp)
            if asking:
                mine = [j for j, p in enumerate(sub) if p.alternatives]
                alt = alternatives(logprobs[to_device(mine, logits.device, torch.long)], [sub[j] for j in mine])
        return tokens, logps, alt


def alternatives(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logprobs [R, V] (each row's log-softmax at its temperature) -> float64 [R, 2N + K], N the rows' largest
    `top_logprobs`, K their longest `token_ids_logprob`: the top N token ids, their log-probs (most likely
    first), then the log-probs of each row's given ids (padding past a row's own). `unpack_alternatives` reads
    a row back."""
    n = min(max(p.top_logprobs for p in params), logprobs.shape[-1])
    k = max(len(p.token_ids_logprob) for p in params)
    parts = []
    if n:
        top = logprobs.topk(n, dim=-1)
        parts += [top.indices.to(torch.float64), top.values.to(torch.float64)]
    if k:
        ids = [list(p.token_ids_logprob) + [0] * (k - len(p.token_ids_logprob)) for p in params]
        parts.append(logprobs.gather(1, to_device(ids, logprobs.device, torch.long)).to(torch.float64))
    return torch.cat(parts, dim=1)


def unpack_alternatives(
    rows: list[list[float]], params: list[SamplingParams], vocab: int
) -> list[tuple[list[tuple[int, float]] | None, list[float] | None]]:
    """`alternatives(logprobs, params)` on the host (its `.tolist()`), row by row: (the top (token id, log-prob)
    pairs, None when not asked; the given ids' log-probs, None when not asked)."""
    n = min(max(p.top_logprobs for p in params), vocab)
    out = []
    for row, p in zip(rows, params):
        top = [(int(row[i]), row[n + i]) for i in range(min(p.top_logprobs, vocab))] if p.top_logprobs else None
        ids = row[2 * n : 2 * n + len(p.token_ids_logprob)] if p.token_ids_logprob else None
        out.append((top, ids))
    return out


def hand_alternatives(
    requests: list, alternatives: list, vocab_size: int, counts: list[int] | None = None, width: int = 1
) -> None:
    """Set each asking request's `step_alternatives` from a step's alternatives (`alternatives`' output as a
    host list: `width` consecutive rows per asking request, the asking requests in the order of `requests`),
    one entry per token the request emitted this step: the first counts[i] of request i's rows (default: one
    token a request, `sample_alternatives`' third output)."""
    asking = [(q, 1 if counts is None else counts[i]) for i, q in enumerate(requests) if q.params.alternatives]
    rows: list = []
    for a, (_, c) in enumerate(asking):
        rows += alternatives[a * width : a * width + c]
    # every asking request keeps >= 1 row, so the unpacking sees the layout's N (the largest top_logprobs)
    both = iter(unpack_alternatives(rows, [q.params for q, c in asking for _ in range(c)], vocab_size))
    for q, c in asking:
        q.step_alternatives = [next(both) for _ in range(c)]


def block_alternatives(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """logits [N, W, V] (row n's at W consecutive positions, under params[n]) -> the `alternatives` of the asking
    rows' positions, float64 [A * W, 2N + K]: the asking rows in order, W rows each (`hand_alternatives`' layout
    with `width` W), read from `reported_logprobs` (the distribution a verify step's emitted tokens' log-probs
    come from); None when no row asks (nothing enqueued)."""
    asking = [i for i, p in enumerate(params) if p.alternatives]
    if not asking:
        return None
    n, width, vocab = logits.shape
    rows = logits if len(asking) == n else logits[to_device(asking, logits.device, torch.long)]
    per = [params[i] for i in asking for _ in range(width)]
    with torch.inference_mode():
        return alternatives(reported_logprobs(rows.reshape(-1, vocab), per), per)


def prompt_alternatives(
    logits: torch.Tensor, params: list[SamplingParams], targets: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt log-probs: logits [R, V] at the rows before prompt positions, row r's request's params[r] and the
    prompt token at the position it predicts, targets[r] -> (log-prob of each target fp32 [R], `alternatives`
    of the rows or None when no param asks), under the same distribution the sampled tokens' log-probs use
    (temperature, 1 when greedy; untruncated)."""
    with torch.inference_mode():
        logprobs = reported_logprobs(logits, params)
        picked = logprobs.gather(1, to_device(targets, logits.device, torch.long)[:, None])[:, 0]
        return picked, alternatives(logprobs, params) if any(p.alternatives for p in params) else None


def reported_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] -> fp32 [R, V] log_softmax(logits / temperature) of row r under params[r] (temperature 1
    when greedy; untruncated): the distribution every reported log-prob and alternative is read from, as
    `_draw_torch` computes it."""
    with torch.inference_mode():
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        scaled = logits.float()
        if any(t != 1.0 for t in temps):
            scaled = scaled / to_device(temps, logits.device, torch.float32)[:, None]
        return torch.log_softmax(scaled, dim=-1)


def sample_scaled(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_keys` for rows that all draw (temperature > 0) without truncation, read from device tensors only
    (temps fp32 [B], keys int64 [2, B]): the form a CUDA graph can hold (the drafter's, `rollout.spec.draft_graphs`)."""
    if kernels.use_kernels(logits):
        from rollout.kernels.sampling import sample_rows  # triton: CUDA builds and the interpreter only

        return sample_rows(logits, temps, keys)
    scaled = logits.float() / temps[:, None]
    tokens = _race(scaled, keys)
    return tokens, torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None])[:, 0]


def _race(score: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The exponential race over scores [B, V] (-inf: excluded): each row's draw with its (seed, position) noise."""
    return (score - torch.log(noise.exponentials(keys[0], keys[1], score.shape[-1]))).argmax(dim=-1)


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def truncates(params: list[SamplingParams], vocab: int) -> bool:
    """Whether any row's top-k or top-p excludes tokens of a `vocab`-token distribution."""
    return any(_truncates(p, vocab) for p in params)


def _sample_torch(
    logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: what `rollout.kernels.sampling.sample_rows` computes, plus truncation."""
    tokens, logps, _ = _draw_torch(logits, params, keys)
    return tokens, logps


def _draw_torch(
    logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor, keep: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_sample_torch`; with `keep`, also the log-softmax [B, V] fp32 the log-probs were read from (else None)."""
    b, vocab = logits.shape
    device = logits.device
    logits = logits.float()
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    scaled = logits if all(t == 1.0 for t in temps) else logits / to_device(temps, device)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        rows = drawn if len(drawn) < b else slice(None)
        rows_t = rows if isinstance(rows, slice) else to_device(drawn, device, torch.long)
        score = scaled[rows]
        kept = [params[i] for i in drawn]
        if truncates(kept, vocab):
            probs = truncate_probs(logprobs[rows].exp(), kept)
            score = torch.where(probs > 0, score, float("-inf"))
        choice = _race(score, keys[:, rows_t])
        tokens = choice if isinstance(rows, slice) else tokens.index_copy(0, rows_t, choice)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0], logprobs if keep else None


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
