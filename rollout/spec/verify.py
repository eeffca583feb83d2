"""Lossless verification of a drafted block: which drafts survive, and the token that follows them.

A row brings its verify forward's logits at gamma + 1 positions (the anchor's, then each draft's), its
drafts x_1..x_gamma and q, the exact distribution each draft was drawn from. Position j's target is p'_j:
softmax(logits_j / temperature) truncated by top-k / top-p and renormalized, exactly as `rollout.sampler`
shapes a draw. Draft j survives with probability min(1, p'_j(x_j) / q_j(x_j)); at the first rejection the
row's next token is drawn from norm(max(p'_j - q_j, 0)) and the block ends; when every draft survives, a
bonus token is drawn from p'_gamma. Each emitted token is then distributed as p' given what precedes it,
whatever q is (speculative sampling's identity). Greedy rows (temperature 0) accept a draft while it equals
the first argmax of the logits and emit the argmax where it first differs: the plain engine's tokens.

Draws: counter-based noise (`rollout.noise`), a function of the request's seed, a stream and the position
of the token it decides, as the plain sampler's: a draft at position p is drawn with the DRAFT stream at p
(`draw`, through the sampler and its kernel), draft p's acceptance test takes the ACCEPT stream's uniform
at p, and the final token at p is drawn from the residual (or p') with the FINAL stream at p. The whole
batch draws in a few launches, and a request's draws depend only on its seed and the positions, never on
its batch, its schedule or how steps split its tokens. Noise is reused only at positions a step left
undecided (after its first rejection): it decided nothing emitted, so it is still independent of
everything emitted, and each emitted token keeps its exact law. Greedy rows draw nothing.

Log-probs: at every emitted position, the verify forward's untruncated log-prob of the emitted token at
the request's temperature (temperature 1 when greedy): the sampler's convention.
"""

from __future__ import annotations

import torch

from rollout import noise
from rollout.request import SamplingParams
from rollout.sampler import sample_keys, sample_scaled, truncate_probs
from rollout.transfer import to_device

DRAFT, ACCEPT, FINAL = 1, 2, 3  # the request's noise streams (`rollout.noise.stream_seed`); 0 is plain sampling's


def stream_seeds(seeds: list[int], stream: int, device: torch.device | str) -> torch.Tensor:
    """[B] int64 on `device`: each request's seed of `stream`."""
    return to_device([noise.stream_seed(s, stream) for s in seeds], device, torch.long)


def _math(t: torch.Tensor) -> torch.Tensor:
    # fp32 like the sampler, fp64 kept for fp64 inputs (the exactness tests)
    return t.to(torch.promote_types(t.dtype, torch.float32))


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (row b under params[b]) -> (log-probs [B, V] of softmax(logits / temperature), the
    sampler's reported distribution; p' [B, V], that distribution truncated by top-k / top-p and
    renormalized, what a draw follows). Greedy rows use temperature 1 and their p' is not meaningful."""
    logits = _math(logits)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    return _warp(logits, to_device(temps, logits.device, logits.dtype), params)


def _warp(
    logits: torch.Tensor, temps: torch.Tensor, params: list[SamplingParams] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`warp` with the temperatures a tensor [B]; `params` None: no row truncates."""
    logp = torch.log_softmax(logits / temps[:, None].to(logits.dtype), dim=-1)
    probs = logp.exp() if params is None else truncate_probs(logp.exp(), params)
    return logp, probs / probs.sum(-1, keepdim=True)


def draw(
    logits: torch.Tensor, params: list[SamplingParams], seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's draw of the token at positions[b] for each row: logits [B, V], seeds [B] the requests'
    DRAFT-stream seeds (`stream_seeds(..., DRAFT, ...)`, device) -> (tokens [B], q [B, V] the exact
    distribution each token came from). Sampled rows draw from p' of their logits (the request's
    temperature / top-k / top-p) with that noise, through the sampler (its kernel on CUDA); greedy rows take
    the first argmax (q one-hot on it). q is None when every row is greedy: greedy verification reads no q,
    and building it (a softmax and a one-hot over the vocabulary for every row and draft position) is, by
    arithmetic, about 4 GB of memory traffic a batch-256 step at k3-small's 163,840-token vocabulary."""
    if all(p.temperature == 0 for p in params):
        return _math(logits).argmax(dim=-1), None
    _, q = warp(logits, params)
    tokens, _ = sample_keys(logits, params, torch.stack([seeds, positions.long()]))
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        rows = to_device(greedy, q.device)
        q = q.index_copy(0, rows, torch.nn.functional.one_hot(tokens[rows], q.shape[-1]).to(q.dtype))
    return tokens, q


def draw_scaled(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw` for rows that all sample (temperature > 0) without truncation, read from device tensors only:
    temps fp32 [B], keys int64 [2, B] (each row's DRAFT-stream seed and drawn position) -> (tokens [B], q [B, V]).
    The same draw and q as `draw` for such rows; the form a CUDA graph can hold (`rollout.spec.draft_graphs`)."""
    tokens, _ = sample_scaled(logits, temps, keys)
    return tokens, _warp(_math(logits), temps, None)[1]


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    params: list[SamplingParams],
    seeds: list[int],
    positions: torch.Tensor,
    num_drafts: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verify step for N rows (see the module docstring).

    logits [N, G + 1, V]: the verify forward's, at the anchor and each draft; drafts [N, G]; q [N, G, V] (None
    when every row is greedy: argmax agreement reads no q);
    seeds: the rows' requests'; positions [N] (device): each anchor's position (draft j sits at
    positions[n] + j);
    `num_drafts[n]` (<= G, default G): how many of row n's drafts are verified (the rest count as rejected
    and are never read). Returns device tensors: tokens [N, G + 1] (row n emits tokens[n, :counts[n]]: its
    surviving drafts, then the correction or bonus token), their log-probs [N, G + 1], counts [N]."""
    n, g1, vocab = logits.shape
    g = g1 - 1
    device = logits.device
    limit = torch.full((n,), g, dtype=torch.long) if num_drafts is None else torch.tensor(num_drafts)
    limit = to_device(limit, device)
    if all(p.temperature == 0 for p in params):
        return _verify_greedy(logits, drafts, limit)
    if q is None:
        raise ValueError("verify: sampled rows need the drafter's q (a drafter returns None only for greedy rows)")
    rows_params = [p for p in params for _ in range(g1)]
    logp, target = warp(logits.reshape(n * g1, vocab), rows_params)
    logp, target = logp.view(n, g1, vocab), target.view(n, g1, vocab)
    greedy_rows = to_device([p.temperature == 0 for p in params], device)
    argmax = _math(logits).argmax(dim=-1)  # [N, G + 1]

    at = positions.long()[:, None] + torch.arange(1, g + 1, device=device)  # each draft's position
    acc = stream_seeds(seeds, ACCEPT, device)[:, None].expand(n, g)
    uniforms = noise.uniforms(acc.reshape(-1), at.reshape(-1), 1).view(n, g).to(target.dtype)

    # which drafts survive
    q = _math(q).to(target.dtype)
    p_x = target[:, :g].gather(2, drafts[..., None])[..., 0]
    q_x = q.gather(2, drafts[..., None])[..., 0]
    sampled_ok = uniforms * q_x < p_x  # u < p'(x) / q(x), without dividing by a zero q
    greedy_ok = drafts == argmax[:, :g]
    ok = torch.where(greedy_rows[:, None], greedy_ok, sampled_ok)
    ok &= torch.arange(g, device=device)[None, :] < limit[:, None]
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [N]: the surviving prefix

    # the final token at position `accepted`: the residual after a rejection, p' after a full block
    idx = accepted[:, None, None].expand(n, 1, vocab)
    p_final = target.gather(1, idx)[:, 0]
    q_final = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, idx)[:, 0]
    rejected = (accepted < limit)[:, None]
    residual = torch.where(rejected, (p_final - q_final).clamp_min(0), p_final)
    # a residual with no mass (p' == q up to rounding) can only be reached by rounding: draw from p'
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_final)
    final = argmax.gather(1, accepted[:, None])[:, 0]
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:  # the residual's draw: the sampler's race over its log, at temperature 1, no truncation
        rows = to_device(sampled, device)
        keys = torch.stack(
            [stream_seeds([seeds[i] for i in sampled], FINAL, device), positions.long()[rows] + accepted[rows] + 1]
        )
        drawn, _ = sample_keys(torch.log(residual[rows]), [SamplingParams(temperature=1.0)] * len(sampled), keys)
        final = final.index_copy(0, rows, drawn)

    tokens = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)
    tokens = tokens.scatter(1, accepted[:, None], final[:, None])
    return tokens, logp.gather(2, tokens[..., None])[..., 0], accepted + 1


def _verify_greedy(
    logits: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify` when every row is greedy: argmax agreement and the log-probs only, none of the sampled path's
    [N, G + 1, V] distributions (at batch 256 and K3's 163,840 ids each one is 0.8 GB in fp32)."""
    n, g = drafts.shape
    x = _math(logits)
    argmax = x.argmax(dim=-1)  # [N, G + 1]
    ok = (drafts == argmax[:, :g]) & (torch.arange(g, device=logits.device)[None, :] < limit[:, None])
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    tokens = torch.cat([drafts, drafts.new_zeros(n, 1)], dim=1)
    tokens = tokens.scatter(1, accepted[:, None], argmax.gather(1, accepted[:, None]))
    logps = torch.log_softmax(x, dim=-1).gather(2, tokens[..., None])[..., 0]  # the sampler's values, bit for bit
    return tokens, logps, accepted + 1
