"""GRPO step throughput: `miles-train` against TRL's `GRPOTrainer` on the same model, in the same run.

    python scripts/bench_grpo_trl.py --device cuda --preset k3-small --steps 6 --json grpo_vs_trl.json
    python scripts/bench_grpo_trl.py --device cpu --preset k3-tiny --steps 3     # smoke run, a few minutes

Both sides train a LoRA adapter with GRPO on the arithmetic task's prompts, from the same base weights:
the Kimi-Linear form of the preset (what transformers' `KimiLinearForCausalLM` can run: K3 without
AttnRes, LatentMoE, SiTU and the full-rank gates), random init with seed 0, written once as an HF
checkpoint that both load. Per step: --prompts prompts x --samples completions of at most
--max-new-tokens tokens at temperature 1, one optimizer step, LoRA rank/alpha on the attention
projections, the dense MLPs, the shared experts and every routed expert (PEFT `target_parameters` for
transformers' fused expert tensors), no KL term, token-mean loss with clip 0.2/0.28. Dynamic sampling is
off on our side (TRL has none), so both do the same work per step.

- miles-k3: the real CLI (`miles-train`, local launcher) in a subprocess; step time from its
  metrics.jsonl (`step_s`: rollout + train + adapter sync). The engine's base is BF16 (no MXFP4) here.
- TRL: `GRPOTrainer` with transformers `generate` (TRL's default without vLLM, which the GPU machine
  lacks); step time from a callback around each optimizer step (generation + loss + backward + step).
- `--k3-form` adds a third row: `miles-train` on the K3 form of the preset with the recipe's engine
  (MXFP4 routed experts), which transformers cannot run.

Needs trl and datasets (not project dependencies): `pip install trl==1.16.0 datasets==5.2.0`; on the GPU
machine, which has accelerate, peft, pandas and pyarrow but no registry, carry the py3.12 wheels of
trl==1.16.0, datasets==5.2.0, dill==0.4.1 and multiprocess==0.70.19 in `.whl/`. The first process on a
fresh GPU machine spends minutes in fla's autotuning: give the call 10 minutes, or run tests/gpu first.

With --reuse and --work-dir, a system whose run in --work-dir already has --steps steps is read back, not
run again: a device call cut by its time limit is continued by the same command in the next call.

--ignore-eos makes every completion --max-new-tokens long on both sides (ours: `rollout.stop_at_eos=false`;
TRL: `min_new_tokens` in its generation kwargs), the RL-length workload (a random base stops at a random eos
after ~vocab-size tokens otherwise).

Steps after the first --warmup are timed; the table gives the median step time, samples/s and the ratio
to TRL. Writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import kimi_linear_form  # noqa: E402

from miles_k3.data.tokenizers import preset_token_ids  # noqa: E402
from miles_k3.model import K3Config, K3ForCausalLM  # noqa: E402
from miles_k3.model.assets import builtin_path  # noqa: E402
from miles_k3.model.base import load_base_config  # noqa: E402
from miles_k3.tasks.arithmetic import ArithmeticTokenizer, check_answer  # noqa: E402

TRAIN_PROMPTS = "builtin:k3-tiny-arith/train.jsonl"
# Our default LoRA targets in the Kimi-Linear form, as PEFT names them: attention q/k/v/o (KDA) and
# q/kv_b/o (MLA), the dense MLP, the shared experts; routed experts through target_parameters.
PEFT_TARGET_MODULES = (
    r".*(self_attn\.(q|k|v|o|kv_b)_proj|mlp\.(gate|up|down)_proj|shared_experts\.(gate|up|down)_proj)$"
)
PEFT_TARGET_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


# The GRPO settings our side takes to match TRL's: token-mean loss, clip 0.2 / 0.28, no KL, one optimizer step a
# step, no dynamic sampling (TRL has none)
ALGO_OVERRIDES = [
    "algo.dynamic_sampling=false",
    "algo.kl=none",
    "algo.reducer=token_mean",
    "algo.eps_low=0.2",
    "algo.eps_high=0.28",
    "algo.updates_per_step=1",
]


def write_base(preset: str, vocab_size: int, path: Path) -> K3Config:
    """The Kimi-Linear form of `preset`, seed-0 random init, saved as an HF checkpoint at `path`."""
    config = kimi_linear_form(
        load_base_config(preset=preset, vocab_size=vocab_size, token_ids=preset_token_ids("arithmetic"))
    )
    torch.manual_seed(0)
    K3ForCausalLM(config).save_pretrained(path)
    return config


def run_ours(args, run_dir: Path, model_overrides: list[str], engine_overrides: list[str]) -> dict:
    """`miles-train` for --steps steps; returns timings parsed from its metrics.jsonl."""
    cluster = "gpu_single" if args.device == "cuda" else "local_cpu"
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    memory = [] if args.device == "cuda" else ["rollout.memory_mb=256"]  # the recipe's 16 GiB pool is for a GPU
    cmd = [
        sys.executable,
        "-m",
        "miles_k3.cli.train",
        "recipe=k3_small_gpu",
        f"cluster={cluster}",
        *model_overrides,
        f"model.train_dtype={dtype}",
        f"rollout.dtype={dtype}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0",
        f"rollout.stop_at_eos={str(not args.ignore_eos).lower()}",
        f"lora.rank={args.rank}",
        f"lora.alpha={args.alpha}",
        f"optim.lr={args.lr}",
        *ALGO_OVERRIDES,
        f"trainer.max_steps={args.steps}",
        "trainer.save_every=0",
        "trainer.eval_every=0",
        "trainer.eval_before=false",
        "trainer.resume=never",
        "logging.wandb=disabled",
        "logging.progress=false",
        *memory,
        *engine_overrides,
        *args.ours_override,
        f"hydra.run.dir={run_dir}",
    ]
    metrics = run_dir / "metrics.jsonl"
    steps = _step_rows(metrics)
    wall = None  # a reused run's wall time belongs to the earlier call
    if not (args.reuse and len(steps) >= args.steps):
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics.unlink(missing_ok=True)  # resume=never starts at step 1; old rows would be read as this run's
        log_path = run_dir.parent / f"{run_dir.name}.log"  # streamed, so a run cut short shows where it was
        start = time.perf_counter()
        with open(log_path, "w") as log_file:
            proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(
                f"miles-train failed ({proc.returncode}), log {log_path}:\n{log_path.read_text()[-4000:]}"
            )
        steps = _step_rows(metrics)
    timed = steps[args.warmup : args.steps]
    return {
        "step_s": [r["step_s"] for r in timed],
        "rollout_s": [r["rollout_s"] for r in timed],
        "train_s": [r["train_s"] for r in timed],
        "adapter_sync_ms": [r["adapter_sync_ms"] for r in timed],
        "reward_mean": [r["reward_mean"] for r in steps],
        "wall_s": wall,
        "command": " ".join(cmd[1:]),
        **{key: [r.get(key) for r in timed] for key in ("rollout_graph_captures", "rollout_graph_replays")},
    }


def _step_rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_s" in r]


def hf_tokenizer():
    """The arithmetic task's character vocabulary as a transformers fast tokenizer (what TRL takes):
    the same ids as `ArithmeticTokenizer`, <bos> prepended, decoding joins characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ours = ArithmeticTokenizer()
    vocab = {tok: i for i, tok in enumerate(ours.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    probe = "12+345="
    assert hf(probe)["input_ids"] == ours.encode(probe, add_bos=True), "tokenizer ids differ from ours"
    return hf


def arithmetic_reward(prompts, completions, label, **_):
    """TRL reward function: 1.0 when the completion's final integer is the label (our checker)."""
    return [float(check_answer(c, lab)) for c, lab in zip(completions, label)]


def run_trl(args, base_dir: Path, out_dir: Path) -> dict:
    """TRL GRPOTrainer for --steps optimizer steps; per-step wall times from a callback."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import KimiLinearForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.device != "cuda":
        from miles_k3.compat.transformers_kimi import use_torch_fallbacks

        use_torch_fallbacks()
    records = [json.loads(line) for line in Path(builtin_path(TRAIN_PROMPTS)).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in records])
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = KimiLinearForCausalLM.from_pretrained(base_dir, dtype=dtype).to(args.device)
    lora = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        target_modules=PEFT_TARGET_MODULES,
        target_parameters=PEFT_TARGET_PARAMETERS,
        task_type="CAUSAL_LM",
    )
    per_step = args.prompts * args.samples
    micro = args.trl_micro_batch or per_step  # sequences per forward / backward; the optimizer step takes them all
    cfg = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        num_iterations=1,
        max_steps=args.steps,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        adam_beta2=0.99,
        weight_decay=0.0,
        bf16=args.device == "cuda",
        use_cpu=args.device != "cuda",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        log_completions=False,
        # --ignore-eos: eos is masked until the last token, so every completion is full length
        generation_kwargs={"min_new_tokens": args.max_new_tokens} if args.ignore_eos else None,
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], None

        def _sync(self):
            if args.device == "cuda":
                torch.cuda.synchronize()

        def on_step_begin(self, *_, **__):
            self._sync()
            self._t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self._sync()
            self.times.append(time.perf_counter() - self._t0)
            print(f"TRL step {len(self.times)}: {self.times[-1]:.1f} s", flush=True)

    saved = out_dir / "result.json"
    if args.reuse and saved.exists():
        res = json.loads(saved.read_text())
        if res["steps"] >= args.steps:
            return {
                **res,
                "step_s": res["step_s_all"][args.warmup : args.steps],
                "rollout_s": res.get("generate_s_all", [])[args.warmup : args.steps],
            }

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its generation (transformers `generate`, rewards, the old log-probs pass) timed
        apart from the rest of the step (loss, backward, optimizer)."""

        def _generate_and_score_completions(self, *a, **kw):
            timer._sync()
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            timer._sync()
            timer.generate.append(time.perf_counter() - t0)
            print(f"TRL generation {len(timer.generate)}: {timer.generate[-1]:.1f} s", flush=True)  # a cut run's
            return out

    timer = StepTimer()
    timer.generate = []
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=hf_tokenizer(),
        peft_config=lora,
        callbacks=[timer],
    )
    adapted = sum(1 for n, _ in trainer.model.named_parameters() if "lora_A" in n)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    res = {
        "steps": args.steps,
        "step_s_all": timer.times,
        "generate_s_all": timer.generate,
        "reward_mean": rewards,
        "wall_s": wall,
        "lora_modules": adapted,
    }
    saved.write_text(json.dumps(res))
    return {**res, "step_s": timer.times[args.warmup :], "rollout_s": timer.generate[args.warmup : args.steps]}


def summarize(name: str, res: dict, samples_per_step: int) -> dict:
    med = statistics.median(res["step_s"])
    row = {"system": name, "step_s": med, "steps_per_s": 1.0 / med, "samples_per_s": samples_per_step / med}
    for key in ("rollout_s", "train_s", "adapter_sync_ms"):
        if res.get(key):
            row[key] = statistics.median(res[key])
    if "rollout_s" in row and "train_s" not in row:  # TRL: the step less its generation
        row["train_s"] = med - row["rollout_s"]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the timing")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every completion runs to --max-new-tokens on both "
        "sides (RL-length rollouts from a random base, which would otherwise stop at a random eos)",
    )
    ap.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="TRL's sequences per forward / backward "
        "(gradient accumulation over the step's samples; default: all at once). Ours micro-batches by "
        "the recipe's parallel.micro_batch_tokens",
    )
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--vocab-size", type=int, default=32)
    ap.add_argument("--k3-form", action="store_true", help="also time miles-train on the K3 form (MXFP4 experts)")
    ap.add_argument(
        "--ours-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override for our side's miles-train (repeat), e.g. rollout.max_running=512",
    )
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument(
        "--skip-ours",
        action="store_true",
        help="TRL alone (a device call of its own at RL lengths; "
        "compare against our rows of another call only as an estimate: machines differ)",
    )
    ap.add_argument("--work-dir", type=Path, default=None, help="run dirs and the base checkpoint (default: temp)")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep a system's finished run of at least --steps steps "
        "found in --work-dir (a call cut by a time limit continues where it stopped)",
    )
    args = ap.parse_args(argv)
    if args.reuse and args.work_dir is None:
        raise ValueError("--reuse needs --work-dir: the runs to reuse live there")
    if args.trl_micro_batch is not None and (args.prompts * args.samples) % args.trl_micro_batch:
        raise ValueError(f"--trl-micro-batch ({args.trl_micro_batch}) must divide --prompts x --samples")
    if args.skip_ours and args.skip_trl:
        raise ValueError("--skip-ours with --skip-trl leaves nothing to run")
    if args.steps <= args.warmup:
        raise ValueError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_grpo_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    base_dir = work / "kimi-linear-base"
    write_base(args.preset, args.vocab_size, base_dir)
    per_step = args.prompts * args.samples
    results, rows = {}, []

    if not args.skip_ours:
        results["miles-k3 (kimi-linear form, no MXFP4)"] = run_ours(
            args,
            work / "ours_kimi",
            [f"model.path={base_dir}", "model.preset=null", "model.vocab_size=null"],
            ["rollout.quantize=none"],
        )
    if args.k3_form and not args.skip_ours:
        results["miles-k3 (k3 form, mxfp4 experts)"] = run_ours(
            args,
            work / "ours_k3",
            [f"model.preset={args.preset}", "model.path=null", f"model.vocab_size={args.vocab_size}"],
            ["rollout.quantize=experts"],
        )
    if not args.skip_trl:
        results["TRL GRPOTrainer (kimi-linear form)"] = run_trl(args, base_dir, work / "trl")
    for name, res in results.items():
        rows.append(summarize(name, res, per_step))
    trl_row = next((r for r in rows if r["system"].startswith("TRL")), None)
    for r in rows:
        r["speedup_vs_trl"] = trl_row["step_s"] / r["step_s"] if trl_row else None

    print(
        f"\nGRPO step, {args.preset} (vocab {args.vocab_size}), {args.device}: {args.prompts} prompts x "
        f"{args.samples} samples, <= {args.max_new_tokens} new tokens, LoRA r={args.rank}; "
        f"median of steps {args.warmup + 1}..{args.steps}"
    )
    print(
        f"{'system':44s} {'step s':>8s} {'rollout s':>9s} {'train s':>8s} {'samples/s':>10s} {'sync ms':>8s} "
        f"{'vs TRL':>7s}"
    )

    def cell(r, key, width, spec):
        return f"{r[key]:{width}{spec}}" if r.get(key) is not None else f"{'-':>{width}s}"

    for r in rows:
        print(
            f"{r['system']:44s} {r['step_s']:8.3f} {cell(r, 'rollout_s', 9, '.3f')} {cell(r, 'train_s', 8, '.3f')} "
            f"{r['samples_per_s']:10.1f} {cell(r, 'adapter_sync_ms', 8, '.2f')} "
            f"{cell(r, 'speedup_vs_trl', 6, '.2f') + 'x' if r['speedup_vs_trl'] else '-':>7s}"
        )

    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    out = {
        "rows": rows,
        "raw": results,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "trl": version("trl"),
            "peft": version("peft"),
            "date": time.strftime("%Y-%m-%d"),
            "host_cpus": os.cpu_count(),
        },
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
