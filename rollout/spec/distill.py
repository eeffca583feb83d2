"""Distilling a DSpark drafter toward its target: offline (scripts/train_drafter.py) and online, on an RL
step's own rollouts (miles_k3.trainer.rollout_worker), with the same blocks, loss and optimizer step.

    seqs = [(prompt_len, prompt + response), ...]            # the target's own generations
    teach = teacher(target, seqs, drafter.config.target_layers)   # offline: every position, kept
    distiller = Distiller(drafter, DistillConfig())
    distiller.step(make_blocks(seqs, teach, rng.sample(anchors(seqs), 128), drafter.config))

    # online: a target pass per batch of blocks over their sequences only, keeping only what the blocks
    # read (memory bounded by the blocks, not by the rollouts' tokens x the vocabulary)
    distiller.distil(seqs, lambda examples: teacher_blocks(target, seqs, examples, drafter.config), rng)

A training example is a block: an anchor at a generated position p (the token the engine would feed as
position 0), the target's tapped states at the `context_window` positions before it (what the drafter sees
in the engine), the next `block_size` tokens of the sequence and the target's distributions over them.
The loss per block position k is DSpark's: 0.1 cross-entropy on the sequence's token + 0.9 total variation
to the target's distribution + 1.0 binary cross-entropy of the confidence head against its target
1 - TV_k (= 1 - 0.5 ||q_k - p_k||_1), positions weighted decay^(k-1).

`Distiller` steps the drafter's own parameters in place (the same tensors: an engine holding the drafter
drafts with the new weights at its next step, nothing rebuilt); the embedding and lm_head it shares with
the target are the target's and never trained. Call it between engine steps, never during one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from rollout.forward import hooks
from rollout.media import packed_media
from rollout.spec.drafter import DSparkConfig, DSparkDrafter, _features

CE_WEIGHT, TV_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0  # DSpark's loss mix


@dataclass(frozen=True)
class DistillConfig:
    """How a drafter is distilled: the optimizer and the loss's position decay. Checked on construction
    (ValueError starting with `DistillConfig.<field>`)."""

    steps: int = 4  # optimizer steps per online distillation (scripts/train_drafter.py sets its own --steps)
    lr: float = 5e-4  # AdamW learning rate
    blocks: int = 128  # blocks (examples) per optimizer step
    decay: float = 0.8  # loss weight ratio of each later block position (position k weighs decay^(k-1))
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # max gradient norm over the drafter's parameters
    warmup_steps: int = 0  # linear warmup of the learning rate over the Distiller's first steps
    # every N-th sequence of an online distillation is held out: the TV before / after is measured on them
    heldout_every: int = 8

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("blocks", 1), ("warmup_steps", 0), ("heldout_every", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DistillConfig.{name} must be an integer >= {low}, got {value!r}")
        for name in ("lr", "decay", "grad_clip", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"DistillConfig.{name} must be a number >= 0, got {value!r}")
        for name in ("lr", "decay", "grad_clip"):
            if getattr(self, name) == 0:
                raise ValueError(f"DistillConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.decay > 1:
            raise ValueError(f"DistillConfig.decay must be <= 1, got {self.decay!r}")


Sequences = list[tuple[int, list[int]]]  # (prompt length, prompt + response) per sequence


class Blocks(NamedTuple):
    """A batch of training blocks (N blocks, C context positions, G = block_size)."""

    ctx: torch.Tensor  # [N, C, F] the target's tapped states before each anchor (left-aligned)
    mask: torch.Tensor  # [N, C] True where ctx is real
    anchors: torch.Tensor  # [N] the token at each anchor position
    tokens: torch.Tensor  # [N, G] the sequence's tokens after the anchor (0 past its end)
    probs: torch.Tensor  # [N, G, V] the target's distribution of each of them (uniform past the end)
    valid: torch.Tensor  # [N, G] True where the sequence has a token

    def to(self, device) -> "Blocks":
        return Blocks(*(t.to(device) for t in self))


@torch.no_grad()
def teacher(
    model,
    seqs: Sequences,
    layers: tuple[int, ...],
    *,
    before_forward: Callable[[list[int]], None] | None = None,
    max_tokens: int = 8192,
    media: list | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: the tapped layers' states [T, F] and the target's next-token distributions [T, V]
    (fp32, on the CPU), from packed forwards of `model` (a K3ForCausalLM: the reference or an engine's) of
    up to `max_tokens` tokens. `before_forward(lengths)` runs before each forward (an engine's model: set
    the adapter batch, so the target is the policy with its adapter). `media`: per sequence, the prompt's
    `rollout.media.PromptMedia` (its `Request.media`) or None: image features spliced in at the pads, as the
    engine's prefill did."""
    by_index = {layer.layer_idx: layer for layer in model.model.layers}
    taps = {f"layer{i}": by_index[i] for i in layers}
    device = next(model.parameters()).device
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = 0
    while start < len(seqs):
        end, total = start, 0
        while end < len(seqs) and (end == start or total + len(seqs[end][1]) <= max_tokens):
            total += len(seqs[end][1])
            end += 1
        chunk = [t for _, t in seqs[start:end]]
        lengths = [len(t) for t in chunk]
        ids = torch.tensor([x for t in chunk for x in t], device=device)[None]
        cu = torch.tensor([0, *lengths], device=device).cumsum(0)
        if before_forward is not None:
            before_forward(lengths)
        store: dict = {}
        with hooks(taps, store):
            h = model.model.hidden(ids, None, cu, media=_media(media, range(start, end), seqs, device))
        feats = _features(store, layers)[0].float().cpu()
        probs = model.logits(h)[0].float().softmax(-1).cpu()
        out += [(feats[a:b], probs[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        start = end
    return out


@torch.no_grad()
def teacher_blocks(
    model,
    seqs: Sequences,
    examples: list[tuple[int, int]],
    config: DSparkConfig,
    *,
    before_forward: Callable[[list[int]], None] | None = None,
    max_tokens: int = 8192,
    media: list | None = None,
) -> Blocks:
    """`make_blocks(seqs, teacher(model, seqs, ...), examples, config)` without keeping the whole teacher:
    packed forwards over the examples' sequences only (up to `max_tokens` tokens each), reading the
    context windows and the lm_head at the block positions only. `before_forward(lengths)` and `media` as
    in `teacher`; `before_forward` again before the lm_head with the one packed row of block positions."""
    window, g = config.context_window, config.block_size
    by_index = {layer.layer_idx: layer for layer in model.model.layers}
    taps = {f"layer{i}": by_index[i] for i in config.target_layers}
    device = next(model.parameters()).device
    n = len(examples)
    ctx = torch.zeros(n, window, len(config.target_layers) * config.hidden_size)
    mask, valid = torch.zeros(n, window, dtype=torch.bool), torch.zeros(n, g, dtype=torch.bool)
    anchor, tokens = torch.zeros(n, dtype=torch.long), torch.zeros(n, g, dtype=torch.long)
    probs = torch.full((n, g, config.vocab_size), 1.0 / config.vocab_size)
    wanted: dict[int, list[int]] = {}  # sequence -> the examples (indices) anchored in it
    for i, (s, _) in enumerate(examples):
        wanted.setdefault(s, []).append(i)
    order = sorted(wanted)
    start = 0
    while start < len(order):
        end, total = start, 0
        while end < len(order) and (end == start or total + len(seqs[order[end]][1]) <= max_tokens):
            total += len(seqs[order[end]][1])
            end += 1
        chunk = order[start:end]
        lengths = [len(seqs[s][1]) for s in chunk]
        ids = torch.tensor([x for s in chunk for x in seqs[s][1]], device=device)[None]
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        if before_forward is not None:
            before_forward(lengths)
        store: dict = {}
        with hooks(taps, store):
            h = model.model.hidden(ids, None, torch.tensor(cu, device=device), media=_media(media, chunk, seqs, device))
        feats = _features(store, config.target_layers)[0]
        rows, slots = [], []  # packed rows whose distributions the blocks need, and where they go
        for s, offset in zip(chunk, cu):
            seq = seqs[s][1]
            for i in wanted[s]:
                p = examples[i][1]
                c = feats[offset + max(0, p - window) : offset + p]
                ctx[i, : len(c)], mask[i, : len(c)] = c.float().cpu(), True
                anchor[i] = seq[p]
                nxt = seq[p + 1 : p + 1 + g]
                tokens[i, : len(nxt)] = torch.tensor(nxt)
                valid[i, : len(nxt)] = True
                rows += range(offset + p, offset + p + len(nxt))  # row j: the distribution of token j + 1
                slots += [(i, k) for k in range(len(nxt))]
        if rows:
            if before_forward is not None:  # the lm_head (an adapter target) sees one packed row of them
                before_forward([len(rows)])
            got = model.logits(h[0, torch.tensor(rows, device=device)]).float().softmax(-1).cpu()
            at = torch.tensor(slots)
            probs[at[:, 0], at[:, 1]] = got
        start = end
    return Blocks(ctx, mask, anchor, tokens, probs, valid)


def _media(media: list | None, chunk, seqs: Sequences, device):
    """The `MediaEmbeds` of one packed teacher row over the sequences at positions `chunk` (None: no images)."""
    if media is None:
        return None
    return packed_media([(media[s], 0, len(seqs[s][1])) for s in chunk], device)


def anchors(seqs: Sequences) -> list[tuple[int, int]]:
    """Every (sequence, anchor position) the engine drafts from: a generated token (the prefill emits the
    first one without a draft) with at least one token after it."""
    return [(s, p) for s, (plen, t) in enumerate(seqs) for p in range(plen, len(t) - 1)]


def make_blocks(seqs: Sequences, teach, examples: list[tuple[int, int]], config: DSparkConfig) -> Blocks:
    """The blocks of `examples` ((sequence, anchor position) pairs) with their context and targets."""
    window, g = config.context_window, config.block_size
    f_dim, vocab = teach[0][0].shape[1], teach[0][1].shape[1]
    n = len(examples)
    ctx, mask = torch.zeros(n, window, f_dim), torch.zeros(n, window, dtype=torch.bool)
    anchor, tokens = torch.zeros(n, dtype=torch.long), torch.zeros(n, g, dtype=torch.long)
    probs, valid = torch.full((n, g, vocab), 1.0 / vocab), torch.zeros(n, g, dtype=torch.bool)
    for i, (s, p) in enumerate(examples):
        seq, (feats, pr) = seqs[s][1], teach[s]
        c = feats[max(0, p - window) : p]
        ctx[i, : len(c)], mask[i, : len(c)] = c, True
        anchor[i] = seq[p]
        nxt = seq[p + 1 : p + 1 + g]
        tokens[i, : len(nxt)] = torch.tensor(nxt)
        probs[i, : len(nxt)] = pr[p : p + len(nxt)]  # pr[j]: the target's distribution of token j + 1
        valid[i, : len(nxt)] = True
    return Blocks(ctx, mask, anchor, tokens, probs, valid)


def block_loss(drafter: DSparkDrafter, blocks: Blocks, decay: float) -> tuple[torch.Tensor, dict[str, float]]:
    """DSpark's loss over `blocks` (module docstring) and its parts: mean CE and mean TV over valid positions."""
    blocks = blocks.to(drafter.fc.weight.device)
    logits, conf = drafter.teacher_forced(blocks.ctx, blocks.mask, blocks.anchors, blocks.tokens)
    valid = blocks.valid
    q = logits.float().softmax(-1)
    ce = F.cross_entropy(logits.float().flatten(0, 1), blocks.tokens.flatten(), reduction="none").view(valid.shape)
    tv = 0.5 * (q - blocks.probs).abs().sum(-1)
    bce = F.binary_cross_entropy(conf.float().clamp(1e-6, 1 - 1e-6), (1 - tv).detach(), reduction="none")
    w = decay ** torch.arange(valid.shape[1], dtype=torch.float32, device=valid.device)[None] * valid
    loss = (w * (CE_WEIGHT * ce + TV_WEIGHT * tv + BCE_WEIGHT * bce)).sum() / w.sum()
    ce, tv, n = ce.detach(), tv.detach(), valid.sum()
    return loss, {"ce": float((ce * valid).sum() / n), "tv": float((tv * valid).sum() / n)}


@torch.no_grad()
def evaluate(drafter: DSparkDrafter, blocks: Blocks, decay: float = DistillConfig.decay) -> dict[str, float]:
    """`block_loss`'s value and parts without gradients: {"loss", "ce", "tv"}."""
    loss, parts = block_loss(drafter, blocks, decay)
    return {"loss": float(loss), **parts}


class Distiller:
    """AdamW over a drafter's own parameters, stepping them in place. Keeps its optimizer state (and the
    warmup's step count) across calls, so online distillations continue one optimization."""

    def __init__(self, drafter: DSparkDrafter, config: DistillConfig):
        self.drafter, self.config = drafter, config
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        warm = config.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    def state_dict(self) -> dict:
        """The optimizer's and the warmup's state (a checkpoint keeps it with the drafter's weights)."""
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])

    def step(self, blocks: Blocks) -> dict[str, float]:
        """One optimizer step on `blocks`: {"loss", "ce", "tv"} before the step."""
        with torch.enable_grad():
            loss, parts = block_loss(self.drafter, blocks, self.config.decay)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        self.opt.step()
        self.drafter.forget_contexts()  # an engine's windows hold keys and values of the old weights
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)  # no gradient buffers kept between distillations
        return {"loss": float(loss.detach()), **parts}

    def distil(
        self, seqs: Sequences, blocks_of: Callable[[list[tuple[int, int]]], Blocks], rng: random.Random
    ) -> dict[str, float]:
        """An online distillation on one batch of sequences (an RL step's rollouts): every
        `heldout_every`-th sequence held out, `steps` optimizer steps of `blocks` blocks sampled from the
        others, and the held-out TV before and after. `blocks_of(examples)` builds the blocks of (sequence,
        anchor) pairs (`teacher_blocks` against the target). Returns {"tv_before", "tv_after", "loss",
        "blocks"} (`loss` of the last step; NaN TVs when no sequence is held out)."""
        c = self.config
        every = c.heldout_every
        held = [i for i in range(len(seqs)) if i % every == every - 1]
        train = [i for i in range(len(seqs)) if i % every != every - 1] or held
        train_x = [(train[s], p) for s, p in anchors([seqs[i] for i in train])]
        held_x = [(held[s], p) for s, p in anchors([seqs[i] for i in held])]
        if not train_x:
            return {"tv_before": float("nan"), "tv_after": float("nan"), "loss": float("nan"), "blocks": 0}
        held_blocks = blocks_of(held_x[: c.blocks * 4]) if held_x else None
        before = evaluate(self.drafter, held_blocks, c.decay)["tv"] if held_blocks else float("nan")
        parts: dict[str, float] = {}
        for _ in range(c.steps):
            parts = self.step(blocks_of(rng.sample(train_x, min(c.blocks, len(train_x)))))
        after = evaluate(self.drafter, held_blocks, c.decay)["tv"] if held_blocks else float("nan")
        return {
            "tv_before": before,
            "tv_after": after,
            "loss": parts["loss"],
            "blocks": c.steps * min(c.blocks, len(train_x)),
        }
