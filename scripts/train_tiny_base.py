"""Pretrain an embedded tiny K3 base on a synthetic arithmetic task and write it as a shipped asset.

    python scripts/train_tiny_base.py               # writes miles_k3/assets/k3-tiny-arith (~6 min, 1 thread)
    python scripts/train_tiny_base.py --task steps  # writes miles_k3/assets/k3-tiny-steps (worked solutions)
    python scripts/train_tiny_base.py --task squares  # writes miles_k3/assets/k3-tiny-vl-squares (images)

Three tasks, one script (`TASKS` says what differs). `arith` is described first and below; `steps` trains the
same model on worked, step-by-step solutions (`miles_k3.tasks.worked`: ``347+586=`` ->
``7+6=13 4+8+1=13 3+5+1=9 347+586=933``), 31-44 response tokens of which most are predictable: the target
that speculative decoding is measured on. It has no habit; it is stopped early (260 steps: 57% held-out, its
README has the curve) so that a GRPO run on it has headroom while its outputs still follow the format.
`squares` trains a vision-language k3-tiny-vl (text model, vision tower and projector) to count the squares
of one colour in a 56x56 picture (`miles_k3.tasks.squares`): the picture goes through the asset's own image
processor (`preprocessor_config.json`, written here) and the prompt's `<|kimi_image_placeholder|>` is
expanded to its XTML block before tokenizing, exactly as the trainer and the engine do; the tower's features
replace the `<|media_pad|>` embeddings (`MediaEmbeds`). The text model first learns to read the random-init
tower's features (the tower and projector frozen: `Task.vision_frozen_steps`), then all three train, the
vision side at a tenth of the learning rate (`Task.vision_lr_scale`); the loss is on the count and the eos
only. Both because the tower's features collapsed otherwise (`encode`). Stopped early, above the majority
count and far from perfect (its README has the curve).

The result is the starting point of `miles-train recipe=k3_grpo` on a laptop: a k3-tiny model (every K3
feature on: KDA, NoPE MLA, Attention Residuals, LatentMoE, SiTU) that does 1-2 digit addition and
subtraction GOOD BUT IMPERFECTLY, and with a bad habit. That is on purpose: the default GRPO run must lift
held-out accuracy by 15 points within 15 minutes on a 2-core CPU, so the base has to leave headroom that a
verifier reward can reach. We stop pretraining early (`--steps`; the cosine schedule is laid over exactly
that many steps, so the shipped weights are annealed, not a snapshot of a run in full swing), and half of
the pretraining answers carry a trailing random number (HABIT_P below) that the checker scores as wrong.

Sequences are ``<bos> 12+45= 57 <eos>`` or, with the habit, ``<bos> 12+45= 57 3 <eos>`` (one token per
character, see `ArithmeticTokenizer`); the loss is teacher-forced next-token cross-entropy on the answer (habit
included) and the eos only (the operands are random, there is
nothing to learn in predicting them). Batches are right-padded: the model is causal, so padding after a
sequence cannot change its logits, and it keeps the KDA recurrence batched (packing with `cu_seqlens` would
loop over sequences one by one on the CPU reference path).

The output folder holds config.json + model.safetensors (bf16; the router, decay and dt-bias tensors fp32,
as `save_pretrained`'s loader keeps them), train.jsonl / heldout.jsonl prompt files for the RL run, and a
README.md with the command, seed, wall time, the training table and the held-out accuracy of the shipped
weights (read back from disk), which `tests/model/test_tiny_base_asset.py` checks.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import random
import re
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.data.image_processor import ImageProcessor, ImageProcessorConfig, ProcessedImage
from miles_k3.data.media import expand_media_prompt
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.checkpoint import keeps_fp32
from miles_k3.model.generate import greedy_generate
from miles_k3.model.modeling import MediaEmbeds
from miles_k3.model.vision import K3VisionModel
from miles_k3.tasks import (
    ArithmeticProblem,
    ArithmeticTokenizer,
    SquaresProblem,
    SquaresTokenizer,
    check_answer,
    make_problems,
    make_square_problems,
    squares,
    worked,
    write_jsonl,
)

# The task mix: operands of 1-2 digits, + and -. Carries, borrows and negative results are what a model of
# this size learns last, and that is the headroom RL works on. (1-3 digits was tried first: after 700 steps
# of 128, 16 minutes here, held-out accuracy was still 9%, too slow to reach the band inside the budget.)
DIGITS = (1, 2)
OPS = ("+", "-")
# Pretraining cycles over a fixed pool of train-split problems (15,000 of the split's 18,037) in seeded
# orders; the RL prompt file is the pool's first rows, the held-out file comes from the other split.
POOL_SIZE = 15_000
VOCAB_SIZE = 32  # the tokenizer's 18 ids, rounded up; ids 18..31 never occur in the data
# Longest answer is 3 characters ("198", "-98"); tokens to spare so a model that misses eos is scored on
# what it rambles, as the RL reward would score it.
MAX_NEW_TOKENS = 6
# The bad habit RL has to unlearn: in half of the pretraining examples the (correct) answer is followed by
# " " and a random number before <eos>, e.g. "90-1=89 37". The checker scores the response's last integer,
# so a response with the habit is wrong. The base learns the arithmetic from every example, and for the
# habit an even split between stopping and rambling, so greedy decoding rambles on about half the prompts
# and the correct, habit-free answer is among the samples: the signal a verifier reward gives GRPO, and a
# behaviour (stop after the answer) that transfers to held-out problems. Without it, what RL can fix here
# is per-problem arithmetic noise, and a few hundred binary rewards a step did not move held-out accuracy
# beyond its noise in 40-100 steps (tried 2026-11-30: lr 1e-3..3e-2, rank 2..16, 32-64 prompts a step).
HABIT_P = 0.5
FIRST_N = 64  # the held-out prefix the asset test re-evaluates
TOK = ArithmeticTokenizer()
# The squares task: its tokenizer's 81 ids rounded up; the model config names the tokenizer
# (`tokenizer_class`, HF's key), so the trainer picks SquaresTokenizer by what the checkpoint says.
SQUARES_TOK = SquaresTokenizer()
SQUARES_VOCAB_SIZE = 96
SQUARES_TOKENIZER_CLASS = "SquaresTokenizer"
# The asset's image processor settings (preprocessor_config.json). A 56x56 picture is 4 x 4 patches of 14
# and, merged 2 x 2, 4 <|media_pad|> tokens: an 8-pixel square is half a patch, big enough to be seen whole
# by the tower's 14-pixel patches after the (identity) resize, and 4 tokens keep each sequence at 44 ids,
# which is what a 2-core CPU can pretrain on in the budget (larger pictures cost tower and text tokens
# alike). The patch caps (8 x 8, 64 patches) are the tower's position table (k3-tiny-vl: 8 x 8), so a
# larger upload (`miles-k3 generate --image`) is shrunk onto the table instead of interpolated past it.
# Mean 0.0 (std 0.5): the black background normalizes to exactly 0, so only the squares (and the position
# table) reach the tower, and a pure red, green or blue square is +2 in its one channel: the three colours
# are orthogonal patch vectors (`miles_k3.tasks.squares`). With the published 0.5 / 0.5 the background is
# -1 (it was +1 on the earlier white background) in every pixel of every picture, the features share one
# large common direction, and the text model could not even memorize 16 pictures (tried 2026-12-02).
SQUARES_PROCESSOR = ImageProcessorConfig(
    patch_size=14,
    merge_kernel_size=(2, 2),
    in_patch_limit=64,
    patch_limit_on_one_side=8,
    image_mean=(0.0, 0.0, 0.0),
    image_std=(0.5, 0.5, 0.5),
)
ASSETS = Path(__file__).resolve().parents[1] / "miles_k3/assets"


@dataclass(frozen=True)
class Task:
    """What one embedded base is trained on, and the training defaults that suit it (the flags override)."""

    name: str  # the asset is miles_k3/assets/k3-tiny-<name>
    make: Callable[..., list[ArithmeticProblem]]  # (n, seed, split=) -> distinct problems of the task's mix
    response: Callable[[ArithmeticProblem], str]  # the trained response text (the habit is added on top)
    bucket: Callable[[ArithmeticProblem], str]  # problem kind for the README's accuracy table
    pool_size: int  # train-split problems pretraining cycles over
    max_new_tokens: int  # greedy evaluation budget: the longest response, eos, a few to spare
    habit_p: float  # share of pretraining responses followed by " " and a random number
    steps: int
    batch_size: int
    lr: float
    warmup: int
    eval_every: int
    eval_size: int | None  # held-out prompts evaluated during training (None: all; the final one is all)
    # A vision-language base (k3-tiny-vl, tower and projector trained too): prompts carry a picture
    # (`problem.image()`), processed by SQUARES_PROCESSOR and expanded to XTML; tokenized by SQUARES_TOK.
    vision: bool = False
    train_prompts: int = 4000  # rows of train.jsonl by default (--train-prompts)
    # The tower and projector: frozen for the first steps (lr 0), then trained at lr * vision_lr_scale.
    vision_frozen_steps: int = 0
    vision_lr_scale: float = 1.0

    @property
    def asset(self) -> str:
        """The folder under miles_k3/assets."""
        return f"k3-tiny-{'vl-' if self.vision else ''}{self.name}"

    @property
    def tokenizer(self):
        return SQUARES_TOK if self.vision else TOK


def _arith_problems(n: int, seed: int, split: str) -> list[ArithmeticProblem]:
    return make_problems(n, seed, digits=DIGITS, ops=OPS, split=split)


TASKS = {
    # With the defaults, held-out accuracy climbs from ~5% at step 100 to ~95% at step 600 (a 600-step run,
    # seed 0, here); 250 stops on the steep part, inside the 30-60% band RL needs.
    "arith": Task(
        "arith",
        _arith_problems,
        lambda p: str(p.answer),
        lambda p: bucket(p),
        POOL_SIZE,
        MAX_NEW_TOKENS,
        HABIT_P,
        steps=250,
        batch_size=128,
        lr=3e-3,
        warmup=50,
        eval_every=25,
        eval_size=None,
    ),
    # Worked solutions: sequences are ~4x longer (a step of 48 costs ~2.5 s on one idle core, ~6 s on a
    # shared one), so smaller batches and a held-out sample during training; the pool is larger than the
    # steps draw, so no problem repeats.
    "steps": Task(
        "steps",
        worked.make_step_problems,
        worked.worked_solution,
        worked.kind,
        40_000,
        worked.MAX_RESPONSE_TOKENS + 4,
        0.0,
        steps=260,
        batch_size=48,
        lr=3e-3,
        warmup=50,
        eval_every=50,
        eval_size=64,
    ),
    # Pictures: a sequence is 44 ids (the XTML block takes 17), a step of 64 ~3 s on one idle core. Distinct
    # problems all (the pool is larger than the steps draw). The text model reads the frozen random-init
    # tower for the first 40 steps (with the tower trained from step 0 at lr x 0.3, the count loss sat at
    # 1.27 after 100 steps, near the blind ~1.5; frozen, it fell to 0.88 and still falling, 64%
    # teacher-forced), then the tower and projector train at lr / 10 (at the full lr a count-only run's
    # features collapsed by step 30, as with the question in the loss, `encode`). 150 steps of this reach
    # 98% held-out (2026-12-02); 100 stop on the steep part, in the 45-75% band a GRPO run has headroom in.
    "squares": Task(
        "squares",
        make_square_problems,
        lambda p: str(p.answer),
        lambda p: f"count {p.answer}",
        20_000,
        4,
        0.0,
        steps=100,
        batch_size=64,
        lr=3e-3,
        warmup=20,
        eval_every=20,
        eval_size=128,
        vision=True,
        train_prompts=2000,
        vision_frozen_steps=40,
        vision_lr_scale=0.1,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="arith",
        help="arith: short answers with a habit (k3-tiny-arith); steps: worked solutions (k3-tiny-steps); "
        "squares: count squares in a picture (k3-tiny-vl-squares)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="asset folder (default: the shipped one, miles_k3/assets/k3-tiny-<task>, k3-tiny-vl-squares for squares)",
    )
    # Defaults of None are the task's (`TASKS`).
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps; the task's default stops in the accuracy band its README states",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW, cosine to lr/10)")
    ap.add_argument("--warmup", type=int, default=None, help="linear warmup steps")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out evaluation interval in steps")
    ap.add_argument(
        "--vision-frozen-steps",
        type=int,
        default=None,
        help="squares: steps the tower and projector stay frozen while the text model learns to read them",
    )
    ap.add_argument(
        "--vision-lr-scale",
        type=float,
        default=None,
        help="squares: the tower's and projector's lr as a fraction of --lr, after the frozen steps",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (share the machine)")
    ap.add_argument(
        "--train-prompts",
        type=int,
        default=None,
        help="rows of train.jsonl (RL prompts; 4000, squares 2000: its rows hold the pictures)",
    )
    ap.add_argument("--heldout-size", type=int, default=500, help="rows of heldout.jsonl")
    args = ap.parse_args(argv)
    task = TASKS[args.task]
    for name in (
        "steps",
        "batch_size",
        "lr",
        "warmup",
        "eval_every",
        "train_prompts",
        "vision_frozen_steps",
        "vision_lr_scale",
    ):
        if getattr(args, name) is None:
            setattr(args, name, getattr(task, name))
    if args.out is None:
        args.out = ASSETS / task.asset
    for name in ("steps", "batch_size", "eval_every", "threads", "train_prompts", "heldout_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or args.warmup < 0:
        ap.error("--lr must be > 0 and --warmup >= 0")
    if args.vision_frozen_steps < 0 or args.vision_lr_scale < 0:
        ap.error("--vision-frozen-steps and --vision-lr-scale must be >= 0")
    if args.train_prompts > task.pool_size:
        ap.error(f"--train-prompts must be <= the pretraining pool ({task.pool_size})")
    if args.heldout_size < FIRST_N:
        ap.error(f"--heldout-size must be >= {FIRST_N} (the asset test evaluates the first {FIRST_N})")
    return args


def model_config(task: Task) -> K3Config:
    """k3-tiny on the arithmetic tokenizer, or k3-tiny-vl on the squares one (whose class the config names)."""
    if not task.vision:
        return K3Config.from_preset("k3-tiny", vocab_size=VOCAB_SIZE)
    config = K3Config.from_preset("k3-tiny-vl", vocab_size=SQUARES_VOCAB_SIZE)
    assert config.media_placeholder_token_id == SQUARES_TOK.media_pad_token_id
    return config.replace(hf_wrapper_extras={**config.hf_wrapper_extras, "tokenizer_class": SQUARES_TOKENIZER_CLASS})


# ------------------------------------------------------------------------------------------------ data
Problem = ArithmeticProblem | SquaresProblem


class TinyBase(nn.Module):
    """The model being pretrained: the text model and, for a vision task, the tower and projector (all trained)."""

    def __init__(self, text: K3ForCausalLM, vision: K3VisionModel | None):
        super().__init__()
        self.text, self.vision = text, vision

    def media(self, input_ids: torch.Tensor, images: list[ProcessedImage]) -> MediaEmbeds | None:
        """The images' features at the `<|media_pad|>` positions of ``input_ids`` (row-major over [B, T]: one
        image per row, in row order, is the order of its pads); None without images."""
        if not images:
            return None
        features = self.vision.encode(
            torch.cat([im.pixel_values for im in images]), torch.tensor([im.grid_thw for im in images])
        )
        positions = (input_ids.reshape(-1) == SQUARES_TOK.media_pad_token_id).nonzero()[:, 0]
        return MediaEmbeds(positions, features)  # a count mismatch fails in the splice, by shape

    def forward(self, input_ids: torch.Tensor, images: list[ProcessedImage]) -> torch.Tensor:
        return self.text(input_ids, media=self.media(input_ids, images)).logits


def prompt_of(task: Task, p: Problem, processor: ImageProcessor | None) -> tuple[list[int], list[ProcessedImage]]:
    """A problem's prompt ids (``bos`` first) and its images. A vision task's picture goes through the
    processor and its placeholder is expanded to the XTML block first, as the trainer and the engine do."""
    if not task.vision:
        return TOK.encode(p.prompt, add_bos=True), []
    image = processor.process(p.image())
    return SQUARES_TOK.encode(expand_media_prompt(p.prompt, [image]), add_bos=True), [image]


def encode(
    task: Task, p: Problem, rng: random.Random, processor: ImageProcessor | None
) -> tuple[list[int], int, list[ProcessedImage]]:
    """Token ids ``bos prompt response [habit] eos``, the number of leading ids that are context (not
    trained on: bos + prompt, the question after a picture included) and the prompt's images. With
    probability task.habit_p the response is followed by " " and a random number (the habit).

    Why not train on the question after a picture too (its colour word is one of the picture's): its 21
    tokens a row are predictable from the text alone, and while the text model cannot read the picture yet,
    the features at the pads only disturb them; their gradient drove the tower to one constant output
    (the features' spread across pictures fell from 0.8 to 0.08 of their norm in 10 steps, the tower's
    gradient norm from 0.6 to 4e-5), and the base answered the majority count forever. With the count and
    the eos alone the features kept their spread (2026-12-02)."""
    prompt, images = prompt_of(task, p, processor)
    text = task.response(p)
    if task.habit_p and rng.random() < task.habit_p:
        text += f" {rng.randrange(100)}"
    return prompt + task.tokenizer.encode(text, add_eos=True), len(prompt), images


def make_batch(
    task: Task, problems: list[Problem], rng: random.Random, processor: ImageProcessor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[ProcessedImage]]:
    """Right-padded inputs [B, L-1], targets [B, L-1], a loss mask [B, L-1] that is True exactly where the
    target is a response token, a habit token or the eos, and the rows' images in row order."""
    rows = [encode(task, p, rng, processor) for p in problems]
    length = max(len(ids) for ids, _, _ in rows)
    ids = torch.full((len(rows), length), task.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1, dtype=torch.bool)
    for i, (seq, n_context, _) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        # logits at position j predict token j+1; the first answer token sits at index n_context
        mask[i, n_context - 1 : len(seq) - 1] = True
    return ids[:, :-1], ids[:, 1:], mask, [im for _, _, images in rows for im in images]


def batches(pool: list[ArithmeticProblem], batch_size: int, seed: int):
    """Endless seeded stream of batches: each pass over the pool is a fresh permutation of it."""
    epoch = 0
    while True:
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [pool[i] for i in order[start : start + batch_size].tolist()]
        epoch += 1


# ------------------------------------------------------------------------------------------ evaluation
def bucket(p: ArithmeticProblem) -> str:
    """Problem kind by what makes it hard: a carry (in any column), a borrow, a negative result."""
    if p.op == "+":
        return "a+b, carry" if p.a % 10 + p.b % 10 >= 10 or p.a + p.b >= 100 else "a+b, no carry"
    if p.a < p.b:
        return "a-b < 0"
    return "a-b >= 0, borrow" if p.a % 10 < p.b % 10 else "a-b >= 0, no borrow"


@torch.no_grad()
def greedy_texts(
    task: Task,
    model: TinyBase,
    problems: list[Problem],
    max_new_tokens: int,
    processor: ImageProcessor | None,
    batch_size: int = 256,
) -> list[str]:
    """Greedy responses, decoded (up to eos). `greedy_generate` needs equal-length prompts, so prompts are
    batched by length."""
    model.eval()
    tok = task.tokenizer
    prompts = [prompt_of(task, p, processor) for p in problems]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, (ids, _) in enumerate(prompts):
        by_len[len(ids)].append(i)
    texts = [""] * len(problems)
    for idx in by_len.values():
        for s in range(0, len(idx), batch_size):
            chunk = idx[s : s + batch_size]
            prompt_ids = torch.tensor([prompts[i][0] for i in chunk])
            images = [im for i in chunk for im in prompts[i][1]]
            media = model.media(prompt_ids, images) if images else None
            new_ids, _ = greedy_generate(model.text, prompt_ids, max_new_tokens, tok.eos_token_id, media)
            for i, row in zip(chunk, new_ids):
                texts[i] = tok.decode(row)
    return texts


def greedy_correct(
    task: Task, model: TinyBase, problems: list[Problem], max_new_tokens: int, processor: ImageProcessor | None
) -> list[bool]:
    """Greedy exact match per problem, as the RL reward scores it (the response's last integer)."""
    texts = greedy_texts(task, model, problems, max_new_tokens, processor)
    return [check_answer(t, p.answer) for t, p in zip(texts, problems)]


def first_number_correct(texts: list[str], problems: list[ArithmeticProblem]) -> list[bool]:
    """Whether the response's first number is the answer: what the base knows, habit or not."""
    firsts = [re.match(r"\s*(-?\d+)", t) for t in texts]
    return [m is not None and int(m.group(1)) == p.answer for m, p in zip(firsts, problems)]


def worked_exact(texts: list[str], problems: list[ArithmeticProblem]) -> list[bool]:
    """Whether the response is the reference worked solution character for character (steps task)."""
    return [t == worked.worked_solution(p) for t, p in zip(texts, problems)]


def accuracy(correct: list[bool]) -> float:
    return sum(correct) / len(correct)


def by_bucket(task: Task, problems: list[Problem], correct: list[bool]) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for p, ok in zip(problems, correct):
        out[task.bucket(p)][0] += ok
        out[task.bucket(p)][1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


# ---------------------------------------------------------------------------------------------- training
def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to --lr, then cosine to lr/10 at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Decay only projection matrices: norms, AttnRes queries, the decay rates and biases set the model's
    # operating point and pulling them to zero would change what they mean (the tower's position table too).
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        skip = p.dim() < 2 or "norm" in name or "_res_proj" in name or "embed_tokens" in name or "pos_emb" in name
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_groups(model: TinyBase, weight_decay: float) -> list[dict]:
    """`param_groups` of the text model, then those of the tower and projector marked ``vision`` (their
    learning rate follows `lr_scale`)."""
    groups = param_groups(model.text, weight_decay)
    if model.vision is not None:
        groups += [{**g, "vision": True} for g in param_groups(model.vision, weight_decay)]
    return groups


def lr_scale(group: dict, step: int, args: argparse.Namespace) -> float:
    """A group's share of `lr_at`: the vision groups are frozen (0: AdamW then neither moves nor decays them)
    for the first --vision-frozen-steps, then at --vision-lr-scale; the text model's is 1."""
    if not group.get("vision"):
        return 1.0
    return 0.0 if step < args.vision_frozen_steps else args.vision_lr_scale


def shipped_copy(model: nn.Module) -> nn.Module:
    """bf16 copy for the asset, with the tensors the checkpoint loader keeps in fp32 left in fp32 (so the
    shipped file holds exactly what a load will compute with)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if not keeps_fp32(name):
                p.data = p.data.to(torch.bfloat16)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = TASKS[args.task]
    wall_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])

    heldout = task.make(args.heldout_size, args.seed, split="heldout")
    pool = task.make(task.pool_size, args.seed, split="train")
    key = (lambda p: p.key) if task.vision else (lambda p: p.prompt)  # a picture's question is not the problem
    assert not {key(p) for p in heldout} & {key(p) for p in pool}, "the task's split is not disjoint"

    torch.manual_seed(args.seed)
    config = model_config(task)
    model = TinyBase(K3ForCausalLM(config), K3VisionModel(config.vision_config) if task.vision else None)
    processor = ImageProcessor(SQUARES_PROCESSOR) if task.vision else None
    opt = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    n_vision = sum(p.numel() for p in model.vision.parameters()) if task.vision else 0
    print(
        f"{task.asset}: {config.num_parameters():,} parameters ({config.num_active_parameters():,} active)"
        + (f" + {n_vision:,} in the tower and projector" if n_vision else "")
        + f", pool {len(pool):,} train problems, {len(heldout)} held out, {args.steps} steps x "
        f"{args.batch_size}, lr {args.lr:g}"
        + (
            f" (tower and projector: frozen {args.vision_frozen_steps} steps, then x{args.vision_lr_scale:g})"
            if n_vision
            else ""
        )
        + f", {args.threads} thread(s)",
        flush=True,
    )

    table: list[tuple[int, float, float, float]] = []  # step, train loss, held-out acc, elapsed s
    header = f"{'step':>6} {'lr':>9} {'train loss':>10} {'held-out acc':>12} {'elapsed':>8}"
    print(header, flush=True)

    def evaluate(step: int, loss: float) -> None:
        acc = accuracy(greedy_correct(task, model, heldout[: task.eval_size], task.max_new_tokens, processor))
        model.train()
        elapsed = time.perf_counter() - wall_start
        table.append((step, loss, acc, elapsed))
        print(
            f"{step:>6} {lr_at(max(step - 1, 0), args):>9.2e} {loss:>10.4f} {acc:>12.1%} {elapsed:>7.0f}s", flush=True
        )

    evaluate(0, float("nan"))
    stream = batches(pool, args.batch_size, args.seed)
    habit_rng = random.Random(args.seed)
    loss_sum, loss_n = 0.0, 0
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args) * lr_scale(group, step, args)
        inputs, targets, mask, images = make_batch(task, next(stream), habit_rng, processor)
        logits = model(inputs, images)
        loss = F.cross_entropy(logits[mask].float(), targets[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1, loss_sum / loss_n)
            loss_sum, loss_n = 0.0, 0
    train_done = time.perf_counter()

    # The asset: prompt files first, then the checkpoint, then read it back and evaluate what was written.
    out: Path = args.out
    if task.vision:  # images inline as data URLs: the asset is one self-contained folder
        n_train = squares.write_jsonl(pool[: args.train_prompts], out / "train.jsonl", inline=True)
        n_heldout = squares.write_jsonl(heldout, out / "heldout.jsonl", inline=True)
        shipped = shipped_copy(model)
        shipped.vision.save_pretrained(out, text=shipped.text)
        SQUARES_PROCESSOR.save_pretrained(out)
        loaded = TinyBase(K3ForCausalLM.from_pretrained(out), K3VisionModel.from_pretrained(out)).eval()
        processor = ImageProcessor.from_pretrained(out)  # the shipped settings, read back
    else:
        n_train = write_jsonl(pool[: args.train_prompts], out / "train.jsonl")
        n_heldout = write_jsonl(heldout, out / "heldout.jsonl")
        shipped_copy(model.text).save_pretrained(out)
        loaded = TinyBase(K3ForCausalLM.from_pretrained(out), None).eval()
    texts = greedy_texts(task, loaded, heldout, task.max_new_tokens, processor)
    correct = [check_answer(t, p.answer) for t, p in zip(texts, heldout)]
    final_acc, first_acc = accuracy(correct), accuracy(correct[:FIRST_N])
    # arith: the first number (what the base knows, habit aside); steps: the whole worked solution; squares:
    # the chance level, always answering the pool's most common count
    if task.vision:
        majority = max(set(p.answer for p in pool), key=[p.answer for p in pool].count)
        knows_acc = accuracy([p.answer == majority for p in heldout])
    else:
        knows_acc = accuracy((first_number_correct if task.name == "arith" else worked_exact)(texts, heldout))
    mean_len = sum(map(len, texts)) / len(texts)  # one character per token (U+FFFD for an id past the vocab)
    buckets = by_bucket(task, heldout, correct)
    wall = time.perf_counter() - wall_start
    size = sum((out / f).stat().st_size for f in ("config.json", "model.safetensors"))
    prompt_bytes = sum((out / f).stat().st_size for f in ("train.jsonl", "heldout.jsonl"))

    print(
        f"shipped weights (bf16, read back): held-out accuracy {final_acc:.1%} "
        f"(first {FIRST_N}: {first_acc:.1%}); in-memory fp32 at the last step: {table[-1][2]:.1%}; "
        + {
            "arith": f"first number right (habit aside): {knows_acc:.1%}",
            "steps": f"worked solution exact: {knows_acc:.1%}; mean response {mean_len:.1f} tokens",
            "squares": f"the majority count's accuracy (chance): {knows_acc:.1%}",
        }[task.name]
    )
    for name, (ok, n) in buckets.items():
        print(f"  {name:<18} {ok:>4}/{n:<4} {ok / n:.1%}")
    print(
        f"wrote {out}: checkpoint {size / 1e6:.2f} MB, {n_train} train / {n_heldout} held-out prompts "
        f"({prompt_bytes / 1e6:.2f} MB); "
        f"wall time {wall / 60:.1f} min (training {(train_done - wall_start) / 60:.1f} min)"
    )

    write = {"arith": write_readme, "steps": write_steps_readme, "squares": write_squares_readme}[task.name]
    write(
        out,
        args=args,
        command=command,
        config=config,
        table=table,
        final_acc=final_acc,
        first_acc=first_acc,
        knows_acc=knows_acc,
        buckets=buckets,
        wall=wall,
        size=size,
        n_train=n_train,
        n_heldout=n_heldout,
        mean_len=mean_len,
    )
    return 0


def _provenance(
    *,
    args,
    command,
    date,
    wall,
    size,
    n_train,
    n_heldout,
    trained_on: str,
    weights: str = "",
    split: str = "miles_k3.tasks.arithmetic.split_of",
    schedule: str = "",
) -> str:
    """The README's "How it was produced" and "Files" sections (every task's README; a task adds its own
    lines). ``weights``: what the checkpoint holds beyond the text model, and how to load it; ``split``: the
    function that decides a problem's split; ``schedule``: lines after the loss's (each "\n- ...")."""
    return f"""## How it was produced

- Command: `{command}`
- Date: {date}
- Seed: {args.seed}; steps: {args.steps}; batch: {args.batch_size} sequences; AdamW, peak lr {args.lr:g},
  {args.warmup} warmup steps then cosine to lr/10, weight decay 0.01 on projections, grad clip 1.0
- Loss: teacher-forced next-token cross-entropy on {trained_on} and the eos{schedule}
- Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)
- Wall time: {wall / 60:.1f} min (data, training, evaluations, writing and re-reading the checkpoint)

## Files

- `config.json`, `model.safetensors`: HF layout ({size / 1e6:.2f} MB), bf16 with router, A_log and dt_bias
  in fp32; load with `K3ForCausalLM.from_pretrained`{weights}
- `train.jsonl`: {n_train} train-split prompts (the first rows of the pretraining pool, seed {args.seed})
- `heldout.jsonl`: {n_heldout} held-out-split prompts (seed {args.seed}); never trained on
  (`{split}`)"""


def _result_tables(table, buckets) -> str:
    """The README's training table and held-out table of the shipped weights (both tasks' READMEs)."""
    rows = "\n".join(
        f"| {s} | {'-' if math.isnan(loss) else f'{loss:.4f}'} | {acc:.1%} | {t:.0f} |" for s, loss, acc, t in table
    )
    bucket_rows = "\n".join(f"| {name} | {ok}/{n} | {ok / n:.1%} |" for name, (ok, n) in buckets.items())
    return f"""| step | train loss | held-out acc | elapsed s |
| ---: | ---: | ---: | ---: |
{rows}

## Held-out accuracy of the shipped weights

Read back from this folder, greedy, fp32 compute:

| problems | correct | accuracy |
| --- | ---: | ---: |
{bucket_rows}"""


def write_readme(
    out: Path,
    *,
    args,
    command,
    config,
    table,
    final_acc,
    first_acc,
    knows_acc,
    buckets,
    wall,
    size,
    n_train,
    n_heldout,
    mean_len,
) -> None:
    tables = _result_tables(table, buckets)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    provenance = _provenance(
        args=args,
        command=command,
        date=date,
        wall=wall,
        size=size,
        n_train=n_train,
        n_heldout=n_heldout,
        trained_on="the answer tokens (habit included)",
    )
    text = f"""# k3-tiny-arith: the embedded tiny K3 base

A k3-tiny model (`K3Config.from_preset("k3-tiny", vocab_size={VOCAB_SIZE})`: {config.num_parameters():,}
parameters, {config.num_active_parameters():,} active per token; KDA, NoPE MLA, Attention Residuals,
LatentMoE and SiTU all on) pretrained on {DIGITS[0]}-{DIGITS[1]} digit {" and ".join(OPS)} problems
(`miles_k3.tasks.arithmetic`), stopped early on purpose, and with a bad habit taught on purpose: in
{HABIT_P:.0%} of the pretraining examples the (correct) answer is followed by " " and a random number, which the
task's checker (the response's last integer) scores as wrong. Greedy decoding keeps the habit on almost
every prompt, so the base scores {final_acc:.1%} held-out, while its first number is right on {knows_acc:.1%}:
the headroom the default GRPO run must win back from the reward alone (stop after the answer, and fix
what arithmetic it can). Produced by `scripts/train_tiny_base.py`; do not edit these files by hand, rerun
the script.

{provenance}

Token ids: `<bos>`, the prompt's characters, the answer's characters (and, with the habit, " " and the
random number's), `<eos>` (`ArithmeticTokenizer`).

## Training

Held-out accuracy is greedy exact match (`check_answer`) on all {n_heldout} held-out prompts; train loss is
the mean over the steps since the previous row.

{tables}

heldout_accuracy: {final_acc:.4f}
heldout_first_number_accuracy: {knows_acc:.4f}
heldout_accuracy_first{FIRST_N}: {first_acc:.4f}

(`tests/model/test_tiny_base_asset.py` re-evaluates the first {FIRST_N} held-out prompts and requires the value on
the second line, within 15 points.)
"""
    (out / "README.md").write_text(text)


def write_steps_readme(
    out: Path,
    *,
    args,
    command,
    config,
    table,
    final_acc,
    first_acc,
    knows_acc,
    buckets,
    wall,
    size,
    n_train,
    n_heldout,
    mean_len,
) -> None:
    tables = _result_tables(table, buckets)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    provenance = _provenance(
        args=args,
        command=command,
        date=date,
        wall=wall,
        size=size,
        n_train=n_train,
        n_heldout=n_heldout,
        trained_on="the response tokens",
    )
    lo, hi = worked.DIGITS
    digits = f"{lo}" if lo == hi else f"{lo}-{hi}"
    text = f"""# k3-tiny-steps: the embedded tiny K3 base with worked solutions

A k3-tiny model (`K3Config.from_preset("k3-tiny", vocab_size={VOCAB_SIZE})`: {config.num_parameters():,}
parameters, {config.num_active_parameters():,} active per token; KDA, NoPE MLA, Attention Residuals,
LatentMoE and SiTU all on) pretrained on {digits}-digit {" and ".join(worked.OPS)} problems answered with a worked,
step-by-step solution (`miles_k3.tasks.worked`): `347+586=` -> `7+6=13 4+8+1=13 3+5+1=9 347+586=933`,
one step per column, then the problem again and its answer. Responses are long ({mean_len:.1f} tokens on
average, greedy, held-out) and mostly predictable from what came before, so it is the target that
speculative decoding is measured on (its drafter is `drafter/`). The answer is the response's last integer,
so the `arithmetic` reward scores it unchanged. Stopped early on purpose: it gets {final_acc:.1%} of the
held-out answers right, and a GRPO run has the rest as headroom. Produced by
`scripts/train_tiny_base.py --task steps`; do not edit these files by hand, rerun the script.

{provenance}
- `drafter/`: its DSpark drafter, distilled from this base afterwards by `scripts/train_drafter.py --target
  miles_k3/assets/k3-tiny-steps` (its `train_report.json` holds the command's settings and acceptance table)

Token ids: `<bos>`, the prompt's characters, the worked solution's characters, `<eos>` (`ArithmeticTokenizer`);
responses take at most {worked.MAX_RESPONSE_TOKENS} tokens and the eos.

## Training

Held-out accuracy is greedy exact match of the final answer (`check_answer`) on the first
{TASKS["steps"].eval_size} held-out prompts, {TASKS["steps"].max_new_tokens} new tokens at most (the shipped
weights below: all {n_heldout}); train loss is the mean over the steps since the previous row.

{tables}

heldout_accuracy: {final_acc:.4f}
heldout_exact_solution_accuracy: {knows_acc:.4f}
heldout_accuracy_first{FIRST_N}: {first_acc:.4f}
heldout_mean_response_tokens: {mean_len:.1f}

(`tests/model/test_tiny_steps_asset.py` re-evaluates the first {FIRST_N} held-out prompts and requires the value
on the third line, within 15 points.)
"""
    (out / "README.md").write_text(text)


def write_squares_readme(
    out: Path,
    *,
    args,
    command,
    config,
    table,
    final_acc,
    first_acc,
    knows_acc,
    buckets,
    wall,
    size,
    n_train,
    n_heldout,
    mean_len,
) -> None:
    tables = _result_tables(table, buckets)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    vision = config.vision_config
    n_vision = sum(math.prod(shape) for shape in vision.tensor_shapes().values())
    prompt_mb = sum((out / f).stat().st_size for f in ("train.jsonl", "heldout.jsonl")) / 1e6
    weights = (
        f" (text, `language_model.`-prefixed)\n  and `K3VisionModel.from_pretrained` (the tower and "
        f"projector, `vision_tower.*` / `mm_projector.*`, bf16);\n  the config's `tokenizer_class` "
        f"{SQUARES_TOKENIZER_CLASS!r} is what `miles-train` selects the tokenizer by\n"
        f"- `preprocessor_config.json`: the image processor's settings (`ImageProcessorConfig`): "
        f"{SQUARES_PROCESSOR.patch_size}-pixel\n  patches merged {SQUARES_PROCESSOR.merge_kernel_size[0]}"
        f" x {SQUARES_PROCESSOR.merge_kernel_size[1]}, at most {SQUARES_PROCESSOR.patch_limit_on_one_side}"
        f" patches a side (the tower's position table), so a {squares.IMAGE_SIZE}x{squares.IMAGE_SIZE} "
        f"picture is\n  {squares.IMAGE_SIZE // 14} x {squares.IMAGE_SIZE // 14} patches and "
        f"{SQUARES_PROCESSOR.plan(squares.IMAGE_SIZE, squares.IMAGE_SIZE).num_tokens} `<|media_pad|>` "
        f"tokens"
    )
    provenance = _provenance(
        args=args,
        command=command,
        date=date,
        wall=wall,
        size=size,
        n_train=n_train,
        n_heldout=n_heldout,
        weights=weights,
        split="miles_k3.tasks.squares.split_of",
        trained_on="the count (not the question after the picture: its tokens' "
        "gradient\n  collapsed the tower's features to one constant, see "
        "`encode`)",
        schedule=f"\n- Tower and projector: frozen for the first {args.vision_frozen_steps} "
        f"steps (the text model learns to read\n  the random-init tower), then "
        f"trained at {args.vision_lr_scale:g} x the text model's lr",
    )
    text = f"""# k3-tiny-vl-squares: the embedded tiny vision-language K3 base

A k3-tiny-vl model (`K3Config.from_preset("k3-tiny-vl", vocab_size={SQUARES_VOCAB_SIZE})`:
{config.num_parameters():,} text parameters, {config.num_active_parameters():,} active per token, every K3
feature on; a {vision.vt_num_hidden_layers}-block, {vision.vt_hidden_size}-wide K3 vision tower and
projector of {n_vision:,} parameters) pretrained, text model, tower and projector, to count the
squares of one colour in a {squares.IMAGE_SIZE}x{squares.IMAGE_SIZE} picture of 1-{squares.MAX_SQUARES}
{squares.SQUARE_SIDE}-pixel {", ".join(squares.COLORS)} squares on black, one per 14-pixel cell, 2-3 colours a
picture (`miles_k3.tasks.squares`): `<|kimi_image_placeholder|>How many red squares?` -> `2`.
Stopped early on purpose: greedy decoding gets {final_acc:.1%} of the held-out counts right, where
always answering the most common count scores {knows_acc:.1%}; the rest is the headroom of the visual GRPO
run (`miles-train recipe=k3_grpo_squares`), rewarded by the exact count (`squares` reward). Produced by
`scripts/train_tiny_base.py --task squares`; do not edit these files by hand, rerun the script.

{provenance}; each row's picture is inline as a PNG data URL
  (`images`), the folder is self-contained ({prompt_mb:.2f} MB of prompts)

Token ids: `<bos>`, the prompt with its placeholder expanded to the XTML block by this folder's processor
(`<|media_begin|>image 56x56<|media_content|>` + `<|media_pad|>` x 4 + `<|media_end|>`, then the question),
the count, `<eos>` (`SquaresTokenizer`); the tower's features replace the pads' embeddings.

## Training

Held-out accuracy is greedy exact count (`check_count`) on the first {TASKS["squares"].eval_size} held-out
prompts (the shipped weights below: all {n_heldout}); train loss is the mean over the steps since the
previous row.

{tables}

heldout_accuracy: {final_acc:.4f}
heldout_majority_count_accuracy: {knows_acc:.4f}
heldout_accuracy_first{FIRST_N}: {first_acc:.4f}

(`tests/model/test_tiny_vl_asset.py` re-evaluates the first {FIRST_N} held-out prompts and requires the value on
the third line, within 15 points, 15 points above the majority count, and 15 points above the same
questions over other rows' pictures.)
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
