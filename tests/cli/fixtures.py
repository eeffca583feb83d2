"""Small inputs for driving `miles-train`: a random-init k3-tiny HF checkpoint with a word-level tokenizer
saved by transformers (built here, no network), prompt files, and the real CLI run in-process."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch

WORDS = "0 1 2 3 4 5 6 7 8 9 + - * = ?".split()

# the default recipe cut to one step of 2 prompts x 2 samples, quiet: what the CLI error tests start from
ONE_SMALL_STEP = [
    "recipe=k3_grpo",
    "logging.wandb=disabled",
    "logging.progress=false",
    "cluster.threads_per_worker=1",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "trainer.max_steps=1",
]


def write_tokenizer(path: Path) -> None:
    """A whitespace-split word-level tokenizer over the digits and operators, as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(path)


def write_checkpoint(path: Path, *, tokenizer: bool = True, seed: int = 0, **overrides) -> Path:
    """`K3ForCausalLM(K3Config.from_preset("k3-tiny", **overrides)).save_pretrained(path)` (random init), plus
    a tokenizer."""
    from miles_k3.model import K3Config, K3ForCausalLM

    torch.manual_seed(seed)
    K3ForCausalLM(K3Config.from_preset("k3-tiny", **overrides)).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path)
    return path


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spaced_arithmetic(n: int = 8) -> list[dict]:
    """Prompts the word-level tokenizer reads ("3 + 4 =") with their labels."""
    return [{"prompt": f"{a} + {b} =", "label": a + b} for a, b in zip(range(n), range(n, 0, -1))]


def run_cli(*argv: str) -> tuple[int, str]:
    """`miles-train argv...` through the console entry point in this process: (exit status, stderr)."""
    from miles_k3.cli.train import main

    err = io.StringIO()
    old = sys.argv
    sys.argv = ["miles-train", *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    return code, err.getvalue()


def write_resume_checkpoint(
    root: Path,
    config,
    records,
    *,
    rank: int = 8,
    workers: int = 1,
    targets: tuple[str, ...] | None = None,
    step: int = 1,
) -> Path:
    """A run checkpoint as GRPODriver.save writes one (PEFT adapter + trainer_state.pt + manifest), with
    zero adapter tensors for the modules `targets` select in `config`'s layout, a fresh sampler position over
    `records` and `workers` trainer-rank states holding the keys a rank's state has (no values)."""
    from miles_k3.data import PromptSampler
    from miles_k3.model.layout import tensor_shapes
    from miles_k3.model.lora_spec import LoraSpec, adaptable_modules
    from miles_k3.model.peft import save_peft
    from miles_k3.trainer import checkpoint as ckpt
    from miles_k3.trainer.inputs import WORKER_STATE_KEYS

    spec = LoraSpec(rank=rank) if targets is None else LoraSpec(rank=rank, targets=targets)
    shapes = tensor_shapes(config)
    adapter = {}
    for m in adaptable_modules(config):
        if not spec.targets_module(m):
            continue
        if ".experts.w" in m:
            prefix, proj = m.rsplit(".", 1)
            out, inp = shapes[f"{prefix}.0.{proj}.weight"]
            lead = (config.num_experts,)
        else:
            (out, inp), lead = shapes[f"{m}.weight"], ()
        adapter[f"{m}.lora_A"] = torch.zeros(*lead, rank, inp)
        adapter[f"{m}.lora_B"] = torch.zeros(*lead, out, rank)

    def write(tmp: Path) -> None:
        save_peft(tmp / ckpt.ADAPTER_DIR, adapter, spec)
        torch.save(
            {
                "step": step,
                "sampler": PromptSampler(records).state_dict(),
                "workers": [dict.fromkeys(WORKER_STATE_KEYS) for _ in range(workers)],
                "config": {},
            },
            tmp / ckpt.STATE_FILE,
        )

    return ckpt.save_checkpoint(root, step, write)
