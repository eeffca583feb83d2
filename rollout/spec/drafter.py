"""Drafters: what proposes a block of tokens for the target to verify.

`Drafter` is the seam the speculative strategy (`rollout.spec.strategy`) calls; `DSparkDrafter` is the
block drafter of DSpark.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from miles_k3.ops import exact
from rollout.forward import hooks
from rollout.media import packed_media
from rollout.request import SamplingParams
from rollout.sampler import truncates
from rollout.spec.contexts import ContextWindows
from rollout.spec.draft_graphs import DraftGraphs
from rollout.spec.verify import DRAFT, draw, draw_scaled, stream_seeds
from rollout.transfer import to_device


class Drafter:
    """Proposes `gamma` tokens per row after each row's anchor (its next input token), with the exact
    distribution q each draft was drawn from (verification is lossless only against the true q).

    Call order, per engine: `attach(runner)` once, then `probe` as the engine's start-up measurement asks;
    `prefilled` after each prefill forward; then per speculative step `propose` before the verify forward
    and `observe` after the accepted lengths are known, and per plain step `observe_plain` at its launch.
    `taps` (filled by `attach`) are target modules whose outputs the strategy reads during the prefill,
    verify and plain forwards and hands to `prefilled` and the observes.

    Draws: a sampled row's draft at position p comes from its request's DRAFT noise stream at p
    (`rollout.spec.verify.draw`), greedy rows draft the argmax and draw nothing.
    """

    max_gamma: int = 1 << 30  # the longest block this drafter can propose
    has_confidence = False  # whether `propose` also returns confidences (the cost-aware planner needs them)
    captures: int = 0  # CUDA graphs the drafter captured so far (a step that captures one is not a timing)
    taps: dict[str, torch.nn.Module] = {}

    def attach(self, runner) -> None:
        """Meet the engine's `ModelRunner` (read the target's shared weights, name `taps`)."""

    def propose(
        self, batch: list, anchors: torch.Tensor, gamma: int, params: list[SamplingParams]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: the rows (`Running`: the anchor sits at r.pos, draft k at r.pos + k); anchors [N] their next
        input tokens (device) -> (drafts [N, gamma]
        long, q [N, gamma, V]: row n's draft j was drawn from q[n, j] given drafts[n, :j]; None when every
        row is greedy, whose verification reads no q), and with
        `has_confidence` a third item, confidences [N, gamma]: c[n, j] estimates that draft j survives
        given the earlier ones did, and reads only the drafts before j."""
        raise NotImplementedError

    def probe(self, rows: int, gamma: int, sampled: bool = False) -> None:
        """Propose for `rows` rows that hold no request, as a step of that many rows proposes (from its CUDA
        graph where steps use one, captured by the probes): the engine's start-up cost probe, which prices
        whole speculative steps (`SpecDecode._probe`). Greedy rows, or with `sampled` rows at temperature 1.
        A drafter with no device work of its own does nothing."""

    def observe(
        self, batch: list, tapped: dict[str, torch.Tensor], lengths: list[int], counts: list[int], starts: list[int]
    ) -> None:
        """After a verify step is read: `tapped[name]` the outputs of `taps` at every fed token ([1, sum
        lengths, ...], row by row, lengths[n] each: the anchor then the drafts), counts[n] the tokens row n
        committed (the anchor and its surviving drafts), from position starts[n] on (the row's `pos` when
        the step was launched)."""

    def observe_plain(self, batch: list, tapped: dict[str, torch.Tensor], starts: list[int]) -> None:
        """As a plain step (one token a row, committed) is launched, before the next step is enqueued: `observe`
        of it (lengths and counts 1), which a drafter may defer until it next proposes (a planner can decode
        plainly for hundreds of steps). `tapped` is a decode graph's static outputs, which the next step's
        replay refills: whatever is kept of them is copied here, in stream order."""
        self.observe(batch, tapped, [1] * len(batch), [1] * len(batch), starts)

    def prefilled(self, rows: list, spans: list[tuple[int, int]], tapped: dict[str, torch.Tensor]) -> None:
        """After one of the engine's packed prefill forwards: row n computed positions spans[n] = (start,
        end), `tapped[name]` the outputs of `taps` at every fed token ([1, sum(end - start), ...], row by
        row)."""


# ----------------------------------------------------------------------------------------- DSpark
_GREEDY = SamplingParams(temperature=0)


@dataclass(frozen=True)
class DSparkConfig:
    """A DSpark block drafter's shape; stored as the drafter directory's `config.json`. Checked on
    construction (ValueError starting with `DSparkConfig.<field>`) and against the target at load."""

    target_layers: tuple[int, ...]  # target decoder layers whose outputs (residual stream) are concatenated
    hidden_size: int  # the target's hidden size (the shared embedding and lm_head fix it)
    vocab_size: int  # the target's vocabulary
    block_size: int = 4  # the most drafts one block proposes (SpecConfig.gamma may be smaller)
    num_layers: int = 2  # draft transformer layers
    num_heads: int = 4  # attention heads per draft layer (hidden_size must divide by it)
    intermediate_size: int = 256  # the draft layers' SiLU-gated MLP width
    markov_rank: int = 16  # rank r of the sequential head's bias W1[x_{k-1}] W2 (W1 [V, r], W2 [r, V])
    context_window: int = 64  # target positions before the anchor a block sees (the latest ones)
    rms_norm_eps: float = 1e-5  # the drafter's RMSNorm epsilon

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        for name in (
            "hidden_size",
            "vocab_size",
            "block_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "markov_rank",
            "context_window",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DSparkConfig.{name} must be an integer >= 1, got {value!r}")
        if not self.target_layers:
            raise ValueError("DSparkConfig.target_layers must name at least one target layer")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"DSparkConfig.num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")

    def check_target(self, target_config) -> None:
        """ValueError naming the field when this drafter does not fit the target model."""
        for name in ("hidden_size", "vocab_size"):
            if getattr(self, name) != getattr(target_config, name):
                raise ValueError(
                    f"DSparkConfig.{name} ({getattr(self, name)}) differs from the target's "
                    f"({getattr(target_config, name)})"
                )
        bad = [i for i in self.target_layers if not 0 <= i < target_config.num_hidden_layers]
        if bad:
            raise ValueError(
                f"DSparkConfig.target_layers {bad} outside the target's {target_config.num_hidden_layers} layers"
            )


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a drafter taps unless told: three evenly spaced ones (1, 3, 5 of 6), fewer on a
    shallower target."""
    return tuple(sorted({(2 * k + 1) * num_layers // 6 for k in range(3)}))


class _DraftLayer(nn.Module):
    """Pre-norm attention (queries from the block; keys / values from the projected target context, then
    the block, all visible: bidirectional inside the block) and a SiLU-gated MLP."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        d = c.hidden_size
        self.heads = c.num_heads
        self.attn_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.ctx_k, self.ctx_v = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.gate = nn.Linear(d, c.intermediate_size, bias=False)
        self.up = nn.Linear(d, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, d, bias=False)

    def context(self, c: torch.Tensor) -> torch.Tensor:
        """The projected context features c [.., D] as this layer's keys and values [.., 2D]: per position, so
        an engine computes them once, when the position's target states arrive (`DSparkDrafter.context`)."""
        return torch.cat([self.ctx_k(c), self.ctx_v(c)], dim=-1)

    def forward(self, x: torch.Tensor, ctx_kv: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """x [N, T, D] the block; ctx_kv [N, C, 2D] the context's keys and values (`context`)."""
        n, t, d = x.shape
        h = self.attn_norm(x)

        def split(y):
            return y.view(n, -1, self.heads, d // self.heads).transpose(1, 2)

        keys = torch.cat([ctx_kv[..., :d], self.k(h)], dim=1)
        values = torch.cat([ctx_kv[..., d:], self.v(h)], dim=1)
        visible = torch.cat([ctx_mask, ctx_mask.new_ones(n, t)], dim=1)[:, None, None, :]
        with exact.outside():  # a drafter only proposes: no log-prob reads its rounding (miles_k3.ops.exact)
            o = F.scaled_dot_product_attention(split(self.q(h)), split(keys), split(values), attn_mask=visible)
        x = x + self.o(o.transpose(1, 2).reshape(n, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DSparkDrafter(nn.Module, Drafter):
    """DSpark's parallel block drafter, conditioned on the target.

    Target hidden states at `target_layers` (the decoder layers' outputs) are concatenated and projected
    (`fc`) into context features, which every draft layer takes as extra keys / values. The block is the
    anchor's embedding at position 0 and a learned mask embedding at positions 1..gamma (plus position
    embeddings), attended bidirectionally; the target's embedding and lm_head are shared and frozen (read
    from the target, not stored; a sharded target's vocab-parallel lm_head is used as the engine uses it,
    this rank's rows and an all-gather of their logits). Position k's logits are the lm_head's on the
    block's output h_k plus the low-rank Markov bias W1[x_{k-1}] W2 (x_0 the anchor), divided by the
    calibrated temperature of position k, and sampled left to right, so q_k is exact given the drafts
    before it. The confidence head c_k = sigmoid(w . [h_k ; W1[x_{k-1}]]) estimates that draft k survives
    given the earlier ones did.

    In the engine the context is the target's states at the request's latest `context_window` computed
    positions, kept as each draft layer's keys and values of them (`context`, computed once a position:
    `ContextWindows`; `forget_contexts` when the weights change): those of each verify forward's committed
    tokens (`observe`, from the tapped layers), and, for
    requests the drafter has not seen (their prompts were prefilled by the engine), one packed target pass
    over their computed tokens (`_catch_up`: the prefill forward's hidden states are not exposed to
    strategies)."""

    def __init__(self, config: DSparkConfig):
        nn.Module.__init__(self)
        c = self.config = config
        d = c.hidden_size
        self.max_gamma = c.block_size
        self.has_confidence = True
        self.fc = nn.Linear(len(c.target_layers) * d, d, bias=False)
        self.fc_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.zeros(d))
        self.pos_embed = nn.Parameter(torch.zeros(c.block_size + 1, d))
        self.layers = nn.ModuleList(_DraftLayer(c) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.markov_in = nn.Embedding(c.vocab_size, c.markov_rank)  # W1
        self.markov_out = nn.Linear(c.markov_rank, c.vocab_size, bias=False)  # W2
        self.confidence = nn.Linear(d + c.markov_rank, 1)
        self.register_buffer("log_temperature", torch.zeros(c.block_size))  # per position, calibrated
        nn.init.zeros_(self.markov_out.weight)  # starts as the plain block drafter
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None  # (embedding [V, D], lm_head [V, D])
        self._gather = None  # a sharded target's vocab-parallel gather of the lm_head's logits (`share`)
        self._runner = None
        # each request's latest target features; plain steps' raw taps projected when read (`defer`)
        self.contexts = ContextWindows(config.context_window, project=self.context)
        self.taps = {}
        self.graphs: DraftGraphs | None = None  # proposals from CUDA graphs (`attach`)

    # ------------------------------------------------------------ the target
    def share(self, target) -> None:
        """Read (never store) the target's embedding and lm_head; name the target layers to tap."""
        self.config.check_target(target.config)
        embed = target.model.embed_tokens.weight
        head = embed if target.config.tie_word_embeddings else target.lm_head.weight
        self._shared = (embed.detach(), head.detach())
        # a sharded engine's lm_head is vocab-parallel (rollout.parallel): this rank's rows, its logits
        # all-gathered in rank order, the whole distribution every rank then draws the same drafts from
        lm_head = None if target.config.tie_word_embeddings else target.lm_head
        self._gather = lm_head.tp.gather_last_dim if getattr(lm_head, "gather", False) else None
        layers = {layer.layer_idx: layer for layer in target.model.layers}
        self.taps = {f"layer{i}": layers[i] for i in self.config.target_layers}

    def attach(self, runner, graphs: bool | None = None) -> None:
        """`graphs`: proposals from CUDA graphs (`rollout.spec.draft_graphs`); None: where the runner's
        decode graphs apply (CUDA) and the target is not sharded (a vocab-parallel lm_head's gather is a
        collective). On CPU True runs their padded shapes eagerly."""
        self.share(runner.model)
        self._runner = runner
        self.to(runner.device).eval()
        if graphs is None:
            graphs = runner.graphs_apply() and self._gather is None
        self.graphs = (
            DraftGraphs(
                self._from_tensors,
                lambda: self.contexts.features,
                runner.config.max_running,
                capture=runner.device.type == "cuda",
            )
            if graphs
            else None
        )

    @property
    def captures(self) -> int:
        return 0 if self.graphs is None else self.graphs.captures

    # ------------------------------------------------------------- the math
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., F] (the tapped layers' states, concatenated) -> every draft layer's context keys
        and values [.., num_layers * 2D]: position by position, so the engine's windows keep these
        (`ContextWindows`) and a proposal computes none (k3-small at batch 256: the 64-position windows' fc
        and key / value projections were most of a proposal's 8 ms on the H200, 2026-12-04)."""
        c = self.fc_norm(self.fc(features.to(self.fc.weight.dtype)))
        return torch.cat([layer.context(c) for layer in self.layers], dim=-1)

    def block_hidden(
        self, ctx_kv: torch.Tensor, ctx_mask: torch.Tensor, anchors: torch.Tensor, gamma: int
    ) -> torch.Tensor:
        """ctx_kv [N, C, num_layers * 2D] the context's keys and values (`context`; ctx_mask [N, C] True where
        real), anchors [N] -> the block's outputs [N, gamma + 1, D] (position 0 the anchor)."""
        embed, _ = self._shared
        n, d = anchors.shape[0], self.config.hidden_size
        x = torch.cat([embed[anchors].to(self.fc.weight.dtype)[:, None], self.mask_embed.expand(n, gamma, d)], dim=1)
        x = x + self.pos_embed[: gamma + 1]
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx_kv[..., 2 * d * i : 2 * d * (i + 1)], ctx_mask)
        return self.norm(x)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The shared lm_head's logits [.., V] of block outputs h [.., D], in h's dtype (the whole vocabulary
        on every rank of a sharded target)."""
        _, head = self._shared
        logits = h @ head.to(h.dtype).t()
        return logits if self._gather is None else self._gather(logits)

    def position_logits(
        self, h: torch.Tensor, prev: torch.Tensor, k: int, base: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft position k (1-based) from its block output h [.., D] and the token before it prev [..]:
        (logits [.., V] after the Markov bias and position k's temperature, confidence [..]). `base`: h's
        `head_logits` when already computed (`propose` computes every position's in one GEMM)."""
        w1 = self.markov_in(prev)
        logits = (self.head_logits(h) if base is None else base.to(h.dtype)) + self.markov_out(w1)
        conf = torch.sigmoid(self.confidence(torch.cat([h, w1], dim=-1)))[..., 0]
        return logits / self.log_temperature[k - 1].exp(), conf

    def teacher_forced(self, ctx, ctx_mask, anchors, block_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: logits [N, G, V] and confidences [N, G] with the true previous tokens (block_tokens
        [N, G], the tokens after the anchor) in the Markov head."""
        g = block_tokens.shape[1]
        h = self.block_hidden(self.context(ctx), ctx_mask, anchors, g)
        prev = torch.cat([anchors[:, None], block_tokens[:, :-1]], dim=1)
        outs = [self.position_logits(h[:, k], prev[:, k - 1], k) for k in range(1, g + 1)]
        return torch.stack([o[0] for o in outs], 1), torch.stack([o[1] for o in outs], 1)

    # ----------------------------------------------------------- the engine
    @torch.inference_mode()
    def propose(self, batch, anchors, gamma, params):
        self.contexts.drop_finished({r.req.request_id for r in batch})
        self._catch_up([r for r in batch if r.req.request_id not in self.contexts])
        rows = self.contexts.rows([r.req.request_id for r in batch])
        greedy = all(p.temperature == 0 for p in params)
        seeds = None if greedy else stream_seeds([r.req.seed for r in batch], DRAFT, anchors.device)
        at = None if greedy else to_device([r.pos for r in batch], anchors.device)
        tensors_only = greedy or (
            all(p.temperature > 0 for p in params) and not truncates(params, self.config.vocab_size)
        )
        if tensors_only and self.graphs is not None and self.graphs.usable(len(batch)):
            sampling = None if greedy else ([p.temperature for p in params], seeds, at)
            return self.graphs.run(rows, anchors, gamma, sampling)
        idx = to_device(rows, anchors.device)
        if greedy:
            return self._from_tensors(idx, anchors, gamma, None)
        return self._block(idx, anchors, gamma, lambda logits, k: draw(logits, params, seeds, at + k))

    @torch.inference_mode()
    def probe(self, rows, gamma, sampled=False):
        # every row reads buffer row 0 (no request's window is changed, a blank one is read as such); the
        # buffer is made as large as the engine runs first, so graphs captured here are not dropped by a
        # growth when the requests arrive (`DraftGraphs`: they read the buffer by address)
        c = self.config
        self.contexts.reserve(
            self._runner.config.max_running,
            2 * c.num_layers * c.hidden_size,
            self.fc.weight.dtype,
            self.fc.weight.device,
        )
        zeros = torch.zeros(rows, dtype=torch.long, device=self.fc.weight.device)  # rows, anchors, seeds, positions
        if self.graphs is not None and self.graphs.usable(rows):
            self.graphs.run([0] * rows, zeros, gamma, ([1.0] * rows, zeros, zeros) if sampled else None, exact=True)
        else:
            self._from_tensors(
                zeros, zeros, gamma, (torch.ones(rows, device=zeros.device), zeros, zeros) if sampled else None
            )

    def _from_tensors(
        self,
        idx: torch.Tensor,
        anchors: torch.Tensor,
        gamma: int,
        sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> tuple:
        """The block of a batch whose rows are all greedy (`sampling` None) or all sample without top-k / top-p
        (`sampling`: temperatures fp32 [N], DRAFT-stream seeds [N], positions [N]), read from device tensors
        only: the form `DraftGraphs` captures."""
        if sampling is None:
            greedy = [_GREEDY] * len(anchors)
            return self._block(idx, anchors, gamma, lambda logits, k: draw(logits, greedy, None, None))
        temps, seeds, at = sampling
        return self._block(
            idx, anchors, gamma, lambda logits, k: draw_scaled(logits, temps, torch.stack([seeds, at + k]))
        )

    def _block(self, idx: torch.Tensor, anchors: torch.Tensor, gamma: int, pick) -> tuple:
        """The block proposal of the windows in buffer rows idx [N] after anchors [N], `pick(logits, k)` drawing
        position k's drafts and their q: drafts [N, gamma], q (None when every row is greedy), confidences
        [N, gamma]."""
        ctx, mask = self.contexts.read_rows(idx)
        h = self.block_hidden(ctx, mask, anchors, gamma)
        # every position's lm_head logits in one GEMM in the head's own dtype: the vocabulary's rows read once a
        # step, not once a position, and never copied to the drafter's dtype (k3-small, by arithmetic: 0.34 GB of bf16
        # rows, 0.67 GB as an fp32 copy). The draws read these logits exactly as computed, so q stays exact.
        base = self.head_logits(h[:, 1:].to(self._shared[1].dtype))
        drafts, qs, confs, prev = [], [], [], anchors
        for k in range(1, gamma + 1):
            logits, conf = self.position_logits(h[:, k], prev, k, base[:, k - 1])  # reads the drafts before k only
            prev, q = pick(logits, k)
            drafts.append(prev)
            qs.append(q)
            confs.append(conf)
        q = None if qs[0] is None else torch.stack(qs, 1)  # None: every row greedy (`draw`)
        return torch.stack(drafts, 1), q, torch.stack(confs, 1)

    def observe(self, batch, tapped, lengths, counts, starts):
        # finished requests' windows go here too, not only in `propose`: a run of plain steps (a batch over
        # SpecConfig.max_batch) proposes nothing while requests finish
        self.contexts.drop_finished({r.req.request_id for r in batch})
        offsets = [0, *itertools.accumulate(lengths)][:-1]  # row n's features in `tapped`
        self.contexts.append(
            [r.req for r in batch], self._context(tapped), offsets, counts, [s + c for s, c in zip(starts, counts)]
        )

    def observe_plain(self, batch, tapped, starts):
        # the raw taps copied out of the graph's outputs here (the cat), in stream order; projected and written
        # when the windows are next read (`ContextWindows.defer`)
        self.contexts.drop_finished({r.req.request_id for r in batch})
        self.contexts.defer(
            [r.req for r in batch], _features(tapped, self.config.target_layers)[0], [s + 1 for s in starts]
        )

    def prefilled(self, rows, spans, tapped):
        """Windows from the engine's own prefill, so that a request needs no catch-up pass: a chunk that
        reaches a window's end extends it past there (a retracted request prefilled again repeats positions
        its window already holds); a chunk from position 0, or one at least a window long, starts one; other
        chunks (after a prefix hit, shorter than a window) leave the request to `_catch_up`, which recomputes
        what the hit skipped."""
        w = self.config.context_window
        picks = []  # (request, offset of its first new feature in `tapped`, how many, the position after them)
        offset = 0
        for r, (s, e) in zip(rows, spans):
            rid, end = r.req.request_id, self.contexts.end(r.req.request_id)
            if end is not None and s <= end:  # continues the window, past the positions it holds
                if e > end:
                    picks.append((r.req, offset + end - s, e - end, e))
            elif s == 0 or e - s >= w:
                if end is not None:
                    self.contexts.drop(rid)
                k = min(w, e - s)
                picks.append((r.req, offset + e - s - k, k, e))
            elif end is not None:
                self.contexts.drop(rid)
            offset += e - s
        if picks:
            reqs, starts, counts, ends = map(list, zip(*picks))
            self.contexts.append(reqs, self._context(tapped), starts, counts, ends)

    def _catch_up(self, rows) -> None:
        """Contexts for requests the drafter has not seen: one packed target pass over their computed
        tokens (no cache: the pools are not touched), the tapped states of the latest positions kept. A
        request's image features are spliced in at its pads as the engine's prefill did (`packed_media`),
        so the drafter reads the target states the engine computed. Requests with the same computed tokens
        and adapter and no images (a GRPO group's samples, before they part) share one row of the pass."""
        if not rows:
            return
        runner = self._runner
        first: dict[tuple, int] = {}  # (adapter, computed tokens) -> the row computed for it
        of = [
            first.setdefault((r.req.adapter, tuple(r.tokens[: r.pos])) if r.req.media is None else (id(r),), i)
            for i, r in enumerate(rows)
        ]
        unique = [rows[i] for i in first.values()]
        lengths = [r.pos for r in unique]
        ids = to_device([t for r in unique for t in r.tokens[: r.pos]], runner.device)[None]
        cu = to_device([0, *lengths], runner.device).cumsum(0)
        if runner.adapters is not None:
            runner.adapters.set_batch([runner.adapters.slot_of(r.req.adapter) for r in unique], lengths)
        media = packed_media([(r.req.media, 0, r.pos) for r in unique], runner.device)  # None: no row has images
        store: dict[str, torch.Tensor] = {}
        with hooks(self.taps, store):
            runner.model.model.hidden(ids, None, cu, media=media)
        ends = dict(zip(first.values(), itertools.accumulate(lengths)))
        keep = [min(r.pos, self.config.context_window) for r in rows]
        self.contexts.append(
            [r.req for r in rows],
            self._context(store),
            [ends[i] - k for i, k in zip(of, keep)],
            keep,
            [r.pos for r in rows],
        )

    @torch.inference_mode()
    def _context(self, tapped: dict[str, torch.Tensor | tuple]) -> torch.Tensor:
        """The draft layers' context keys and values [T, num_layers * 2D] of the tapped positions: what the
        windows keep."""
        return self.context(_features(tapped, self.config.target_layers)[0])

    def forget_contexts(self) -> None:
        """Drop every request's window: they hold keys and values of the drafter's weights as they were, so
        whatever changes the weights in place (a distillation step, a load) calls this; requests then catch
        up (`_catch_up`) on their next proposal."""
        self.contexts.clear()  # the deferred raw taps too: requests catch up whole

    # ------------------------------------------------------------ save / load
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path / "model.safetensors")
        )

    @classmethod
    def load(cls, path: str | Path, target=None) -> "DSparkDrafter":
        """A drafter directory (`config.json` + `model.safetensors`); checked against `target` when given."""
        path = Path(path)
        for name in ("config.json", "model.safetensors"):
            if not (path / name).is_file():
                raise ValueError(
                    f"SpecConfig.drafter: {path / name} not found (a DSpark drafter directory holds "
                    f"config.json and model.safetensors, written by scripts/train_drafter.py)"
                )
        try:
            config = DSparkConfig(**json.loads((path / "config.json").read_text()))
        except (TypeError, ValueError) as e:  # not JSON (JSONDecodeError, UnicodeDecodeError), or not a mapping
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"SpecConfig.drafter: {path / 'config.json'}: not a DSpark drafter config ({reason})"
            ) from None
        if target is not None:
            config.check_target(target.config)
        drafter = cls(config)
        drafter.load_state_dict(load_file(str(path / "model.safetensors")))
        return drafter


def _features(tapped: dict[str, torch.Tensor | tuple], layers: tuple[int, ...]) -> torch.Tensor:
    """The tapped decoder layers' outputs (their residual stream h) concatenated: [B, T, len(layers) * D]."""
    outs = [tapped[f"layer{i}"] for i in layers]
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=-1)
