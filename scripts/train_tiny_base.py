"""Pretrain an embedded tiny K3 base on a synthetic arithmetic task and write it as a shipped asset.

    python scripts/train_tiny_base.py               # writes miles_k3/assets/k3-tiny-arith (~6 min, 1 thread)
    python scripts/train_tiny_base.py --task steps  # writes miles_k3/assets/k3-tiny-steps (worked solutions)

Two tasks, one script (`TASKS` says what differs). `arith` is described first and below; `steps` trains the
same model on worked, step-by-step solutions (`miles_k3.tasks.worked`: ``347+586=`` ->
``7+6=13 4+8+1=13 3+5+1=9 347+586=933``), 31-44 response tokens of which most are predictable: the target
that speculative decoding is measured on. It has no habit; it is stopped early (260 steps: 57% held-out, its
README has the curve) so that a GRPO run on it has headroom while its outputs still follow the format.

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

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.checkpoint import keeps_fp32
from miles_k3.model.generate import greedy_generate
from miles_k3.tasks import ArithmeticProblem, ArithmeticTokenizer, check_answer, make_problems, worked, write_jsonl

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


def _arith_problems(n: int, seed: int, split: str) -> list[ArithmeticProblem]:
    return make_problems(n, seed, digits=DIGITS, ops=OPS, split=split)


TASKS = {
    # With the defaults, held-out accuracy climbs from ~5% at step 100 to ~95% at step 600 (a 600-step run,
    # seed 0, here); 250 stops on the steep part, inside the 30-60% band RL needs.
    "arith": Task("arith", _arith_problems, lambda p: str(p.answer), lambda p: bucket(p), POOL_SIZE,
                  MAX_NEW_TOKENS, HABIT_P, steps=250, batch_size=128, lr=3e-3, warmup=50, eval_every=25,
                  eval_size=None),
    # Worked solutions: sequences are ~4x longer (a step of 48 costs ~2.5 s on one idle core, ~6 s on a
    # shared one), so smaller batches and a held-out sample during training; the pool is larger than the
    # steps draw, so no problem repeats.
    "steps": Task("steps", worked.make_step_problems, worked.worked_solution, worked.kind, 40_000,
                  worked.MAX_RESPONSE_TOKENS + 4, 0.0, steps=260, batch_size=48, lr=3e-3, warmup=50,
                  eval_every=50, eval_size=64),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="arith",
                    help="arith: short answers with a habit (k3-tiny-arith); steps: worked solutions (k3-tiny-steps)")
    ap.add_argument("--out", type=Path, default=None,
                    help="asset folder (default: the shipped one, miles_k3/assets/k3-tiny-<task>)")
    # Defaults of None are the task's (`TASKS`).
    ap.add_argument("--steps", type=int, default=None,
                    help="optimizer steps; the task's default stops in the accuracy band its README states")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW, cosine to lr/10)")
    ap.add_argument("--warmup", type=int, default=None, help="linear warmup steps")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out evaluation interval in steps")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (share the machine)")
    ap.add_argument("--train-prompts", type=int, default=4000, help="rows of train.jsonl (RL prompts)")
    ap.add_argument("--heldout-size", type=int, default=500, help="rows of heldout.jsonl")
    args = ap.parse_args(argv)
    task = TASKS[args.task]
    for name in ("steps", "batch_size", "lr", "warmup", "eval_every"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(task, name))
    if args.out is None:
        args.out = ASSETS / f"k3-tiny-{task.name}"
    for name in ("steps", "batch_size", "eval_every", "threads", "train_prompts", "heldout_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0 or args.warmup < 0:
        ap.error("--lr must be > 0 and --warmup >= 0")
    if args.train_prompts > task.pool_size:
        ap.error(f"--train-prompts must be <= the pretraining pool ({task.pool_size})")
    if args.heldout_size < FIRST_N:
        ap.error(f"--heldout-size must be >= {FIRST_N} (the asset test evaluates the first {FIRST_N})")
    return args


def model_config() -> K3Config:
    return K3Config.from_preset("k3-tiny", vocab_size=VOCAB_SIZE)


# ------------------------------------------------------------------------------------------------ data
def encode(task: Task, p: ArithmeticProblem, rng: random.Random) -> tuple[list[int], int]:
    """Token ids ``bos prompt response [habit] eos`` and the number of leading ids that are context (bos +
    prompt). With probability task.habit_p the response is followed by " " and a random number (the habit)."""
    prompt = TOK.encode(p.prompt, add_bos=True)
    text = task.response(p)
    if task.habit_p and rng.random() < task.habit_p:
        text += f" {rng.randrange(100)}"
    return prompt + TOK.encode(text, add_eos=True), len(prompt)


def make_batch(task: Task, problems: list[ArithmeticProblem], rng: random.Random) -> tuple[torch.Tensor,
                                                                                          torch.Tensor, torch.Tensor]:
    """Right-padded inputs [B, L-1], targets [B, L-1] and a loss mask [B, L-1] that is True exactly where the
    target is a response token, a habit token or the eos."""
    rows = [encode(task, p, rng) for p in problems]
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), TOK.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1, dtype=torch.bool)
    for i, (seq, n_context) in enumerate(rows):
        ids[i, :len(seq)] = torch.tensor(seq)
        # logits at position j predict token j+1; the first answer token sits at index n_context
        mask[i, n_context - 1:len(seq) - 1] = True
    return ids[:, :-1], ids[:, 1:], mask


def batches(pool: list[ArithmeticProblem], batch_size: int, seed: int):
    """Endless seeded stream of batches: each pass over the pool is a fresh permutation of it."""
    epoch = 0
    while True:
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [pool[i] for i in order[start:start + batch_size].tolist()]
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
def greedy_texts(model: K3ForCausalLM, problems: list[ArithmeticProblem], max_new_tokens: int,
                 batch_size: int = 256) -> list[str]:
    """Greedy responses, decoded (up to eos). `greedy_generate` needs equal-length prompts, so prompts are
    batched by length."""
    model.eval()
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(problems):
        by_len[len(p.prompt)].append(i)
    texts = [""] * len(problems)
    for idx in by_len.values():
        for s in range(0, len(idx), batch_size):
            chunk = idx[s:s + batch_size]
            prompt_ids = torch.tensor([TOK.encode(problems[i].prompt, add_bos=True) for i in chunk])
            new_ids, _ = greedy_generate(model, prompt_ids, max_new_tokens, eos_token_id=TOK.eos_token_id)
            for i, row in zip(chunk, new_ids):
                texts[i] = TOK.decode(row)
    return texts


def greedy_correct(model: K3ForCausalLM, problems: list[ArithmeticProblem], max_new_tokens: int) -> list[bool]:
    """Greedy exact match per problem, as the RL reward scores it (the response's last integer)."""
    return [check_answer(t, p.answer) for t, p in zip(greedy_texts(model, problems, max_new_tokens), problems)]


def first_number_correct(texts: list[str], problems: list[ArithmeticProblem]) -> list[bool]:
    """Whether the response's first number is the answer: what the base knows, habit or not."""
    firsts = [re.match(r"\s*(-?\d+)", t) for t in texts]
    return [m is not None and int(m.group(1)) == p.answer for m, p in zip(firsts, problems)]


def worked_exact(texts: list[str], problems: list[ArithmeticProblem]) -> list[bool]:
    """Whether the response is the reference worked solution character for character (steps task)."""
    return [t == worked.worked_solution(p) for t, p in zip(texts, problems)]


def accuracy(correct: list[bool]) -> float:
    return sum(correct) / len(correct)


def by_bucket(task: Task, problems: list[ArithmeticProblem], correct: list[bool]) -> dict[str, tuple[int, int]]:
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


def param_groups(model: K3ForCausalLM, weight_decay: float) -> list[dict]:
    # Decay only projection matrices: norms, AttnRes queries, the decay rates and biases set the model's
    # operating point and pulling them to zero would change what they mean.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        skip = p.dim() < 2 or "norm" in name or "_res_proj" in name or "embed_tokens" in name
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def shipped_copy(model: K3ForCausalLM) -> K3ForCausalLM:
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
    assert not {p.prompt for p in heldout} & {p.prompt for p in pool}, "make_problems split is not disjoint"

    torch.manual_seed(args.seed)
    config = model_config()
    model = K3ForCausalLM(config)
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    print(f"k3-tiny-{task.name}: {config.num_parameters():,} parameters ({config.num_active_parameters():,} active), "
          f"pool {len(pool):,} train problems, {len(heldout)} held out, {args.steps} steps x {args.batch_size}, "
          f"lr {args.lr:g}, {args.threads} thread(s)", flush=True)

    table: list[tuple[int, float, float, float]] = []  # step, train loss, held-out acc, elapsed s
    header = f"{'step':>6} {'lr':>9} {'train loss':>10} {'held-out acc':>12} {'elapsed':>8}"
    print(header, flush=True)

    def evaluate(step: int, loss: float) -> None:
        acc = accuracy(greedy_correct(model, heldout[:task.eval_size], task.max_new_tokens))
        model.train()
        elapsed = time.perf_counter() - wall_start
        table.append((step, loss, acc, elapsed))
        print(f"{step:>6} {lr_at(max(step - 1, 0), args):>9.2e} {loss:>10.4f} {acc:>12.1%} {elapsed:>7.0f}s",
              flush=True)

    evaluate(0, float("nan"))
    stream = batches(pool, args.batch_size, args.seed)
    habit_rng = random.Random(args.seed)
    loss_sum, loss_n = 0.0, 0
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        inputs, targets, mask = make_batch(task, next(stream), habit_rng)
        logits = model(inputs).logits
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
    n_train = write_jsonl(pool[:args.train_prompts], out / "train.jsonl")
    n_heldout = write_jsonl(heldout, out / "heldout.jsonl")
    shipped_copy(model).save_pretrained(out)
    loaded = K3ForCausalLM.from_pretrained(out).eval()
    texts = greedy_texts(loaded, heldout, task.max_new_tokens)
    correct = [check_answer(t, p.answer) for t, p in zip(texts, heldout)]
    final_acc, first_acc = accuracy(correct), accuracy(correct[:FIRST_N])
    # arith: the first number (what the base knows, habit aside); steps: the whole worked solution
    knows_acc = accuracy((first_number_correct if task.name == "arith" else worked_exact)(texts, heldout))
    mean_len = sum(map(len, texts)) / len(texts)  # one character per token (U+FFFD for an id past the vocab)
    buckets = by_bucket(task, heldout, correct)
    wall = time.perf_counter() - wall_start
    size = sum((out / f).stat().st_size for f in ("config.json", "model.safetensors"))

    print(f"shipped weights (bf16, read back): held-out accuracy {final_acc:.1%} "
          f"(first {FIRST_N}: {first_acc:.1%}); in-memory fp32 at the last step: {table[-1][2]:.1%}; "
          + (f"first number right (habit aside): {knows_acc:.1%}" if task.name == "arith" else
             f"worked solution exact: {knows_acc:.1%}; mean response {mean_len:.1f} tokens"))
    for name, (ok, n) in buckets.items():
        print(f"  {name:<18} {ok:>4}/{n:<4} {ok / n:.1%}")
    print(f"wrote {out}: checkpoint {size / 1e6:.2f} MB, {n_train} train / {n_heldout} held-out prompts; "
          f"wall time {wall / 60:.1f} min (training {(train_done - wall_start) / 60:.1f} min)")

    write = write_readme if task.name == "arith" else write_steps_readme
    write(out, args=args, command=command, config=config, table=table, final_acc=final_acc,
                 first_acc=first_acc, knows_acc=knows_acc, buckets=buckets, wall=wall, size=size, n_train=n_train,
                 n_heldout=n_heldout, mean_len=mean_len)
    return 0


def _provenance(*, args, command, date, wall, size, n_train, n_heldout, trained_on: str) -> str:
    """The README's "How it was produced" and "Files" sections (both tasks' READMEs; a task adds its own lines)."""
    return f"""## How it was produced

- Command: `{command}`
- Date: {date}
- Seed: {args.seed}; steps: {args.steps}; batch: {args.batch_size} sequences; AdamW, peak lr {args.lr:g},
  {args.warmup} warmup steps then cosine to lr/10, weight decay 0.01 on projections, grad clip 1.0
- Loss: teacher-forced next-token cross-entropy on {trained_on} and the eos
- Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)
- Wall time: {wall / 60:.1f} min (data, training, evaluations, writing and re-reading the checkpoint)

## Files

- `config.json`, `model.safetensors`: HF layout ({size / 1e6:.2f} MB), bf16 with router, A_log and dt_bias
  in fp32; load with `K3ForCausalLM.from_pretrained`
- `train.jsonl`: {n_train} train-split prompts (the first rows of the pretraining pool, seed {args.seed})
- `heldout.jsonl`: {n_heldout} held-out-split prompts (seed {args.seed}); never trained on
  (`miles_k3.tasks.arithmetic.split_of`)"""


def _result_tables(table, buckets) -> str:
    """The README's training table and held-out table of the shipped weights (both tasks' READMEs)."""
    rows = "\n".join(f"| {s} | {'-' if math.isnan(loss) else f'{loss:.4f}'} | {acc:.1%} | {t:.0f} |"
                     for s, loss, acc, t in table)
    bucket_rows = "\n".join(f"| {name} | {ok}/{n} | {ok / n:.1%} |" for name, (ok, n) in buckets.items())
    return f"""| step | train loss | held-out acc | elapsed s |
| ---: | ---: | ---: | ---: |
{rows}

## Held-out accuracy of the shipped weights

Read back from this folder, greedy, fp32 compute:

| problems | correct | accuracy |
| --- | ---: | ---: |
{bucket_rows}"""


def write_readme(out: Path, *, args, command, config, table, final_acc, first_acc, knows_acc, buckets, wall, size,
                 n_train, n_heldout, mean_len) -> None:
    tables = _result_tables(table, buckets)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    provenance = _provenance(args=args, command=command, date=date, wall=wall, size=size, n_train=n_train,
                             n_heldout=n_heldout, trained_on="the answer tokens (habit included)")
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


def write_steps_readme(out: Path, *, args, command, config, table, final_acc, first_acc, knows_acc, buckets, wall,
                       size, n_train, n_heldout, mean_len) -> None:
    tables = _result_tables(table, buckets)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    provenance = _provenance(args=args, command=command, date=date, wall=wall, size=size, n_train=n_train,
                             n_heldout=n_heldout, trained_on="the response tokens")
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


if __name__ == "__main__":
    sys.exit(main())
