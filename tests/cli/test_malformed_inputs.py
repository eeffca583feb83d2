"""Every user mistake `miles-train` meets ends with exit status 2 and ONE line on stderr naming the field or
the file, never a traceback: malformed configs, run directories, checkpoints, tokenizers, datasets and
reward plugins, resume checkpoints (CASES, over a hundred; tests/cli/test_cli_errors.py drives every command
as a subprocess over the mistakes of the other layers).

How they run: in this process through the console entry point (`miles_k3.cli.train.main` with sys.argv,
SystemExit and stderr captured), since nearly all fail at config or input time, before any model is built;
the reward plugins that fail on the run's own samples (`MID_RUN`) build the tiny model first. The cases in
`SUBPROCESS` run again as true subprocesses of the installed console script (`.venv/bin/miles-train`), so
that Hydra's own error handling, logging and the process exit status are the real ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_k3.data import PromptDataConfig, load_prompts
from miles_k3.model import K3Config
from tests.cli.fixtures import (
    ONE_SMALL_STEP,
    run_cli,
    spaced_arithmetic,
    write_checkpoint,
    write_prompts,
    write_resume_checkpoint,
)

ASSET = Path(__file__).resolve().parents[2] / "miles_k3" / "assets" / "k3-tiny-arith"
REPO = Path(__file__).resolve().parents[2]
BASE = [*ONE_SMALL_STEP, "data.eval_max_prompts=2"]
PLUGINS = "tests.cli.plugins.bad_rewards"

# (case id, overrides ({d}: the directory of malformed inputs), text the one line must contain)
CASES = [
    # --- composition: unknown keys and group options, wrong types (Hydra / OmegaConf) ---
    ("unknown-key", ["trainer.max_stepz=3"], "trainer.max_stepz"),
    ("unknown-section-key", ["rollout.topp=0.9"], "rollout.topp"),
    ("wrong-type-int", ["trainer.max_steps=many"], "trainer.max_steps"),
    ("wrong-type-float", ["optim.lr=fast"], "optim.lr"),
    ("wrong-type-top-k", ["rollout.top_k=2.5"], "rollout.top_k"),
    ("wrong-type-list", ["lora.targets=q_proj"], "lora.targets"),
    ("unknown-key-added-with-plus", ["+trainer.extra_key=1"], "trainer.extra_key"),
    ("unknown-nested-key-added-with-plus", ["+rollout.speculative.extra=1"], "rollout.speculative.extra"),
    ("unknown-algo", ["algo=nope"], "algo/nope"),
    ("unknown-model", ["model=nope"], "model/nope"),
    ("bad-override-syntax", ["rollout.top_p=[0.5"], "rollout.top_p"),
    # --- values: each section's own rules and the cross-section ones ---
    ("top-p-above-1", ["rollout.top_p=1.5"], "rollout.top_p"),
    ("top-p-zero", ["rollout.top_p=0"], "rollout.top_p"),
    ("top-p-negative", ["rollout.top_p=-0.1"], "rollout.top_p"),
    ("top-k-negative", ["rollout.top_k=-5"], "rollout.top_k"),
    ("temperature-zero", ["rollout.temperature=0"], "rollout.temperature"),
    ("temperature-negative", ["rollout.temperature=-1"], "rollout.temperature"),
    ("temperature-nan", ["rollout.temperature=nan"], "rollout.temperature"),
    ("max-new-tokens-zero", ["rollout.max_new_tokens=0"], "rollout.max_new_tokens"),
    ("group-of-one", ["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt"),
    ("no-prompts", ["rollout.prompts_per_step=0"], "rollout.prompts_per_step"),
    ("memory-negative", ["rollout.memory_mb=-1"], "rollout.memory_mb"),
    ("memory-too-small", ["rollout.memory_mb=0.001"], "rollout.memory_mb"),
    ("chunk-not-page-multiple", ["rollout.chunk_size=24"], "rollout.chunk_size"),
    ("prefill-not-chunk-multiple", ["rollout.max_prefill_tokens=100"], "rollout.max_prefill_tokens"),
    ("quantize-unknown", ["rollout.quantize=int3"], "rollout.quantize"),
    ("rollout-dtype-unknown", ["rollout.dtype=float16"], "rollout.dtype"),
    ("overlap-unknown", ["rollout.overlap=yes"], "rollout.overlap"),
    ("compile-decode-on-cpu", ["rollout.compile_decode=true"], "rollout.compile_decode"),
    ("triton-on-cpu", ["rollout.mxfp4_matmul=triton", "rollout.quantize=experts"], "rollout.mxfp4_matmul"),
    ("eps-high-negative", ["algo.eps_high=-1"], "algo.eps_high"),
    ("eps-low-above-1", ["algo.eps_low=1.5"], "algo.eps_low"),
    ("kl-unknown", ["algo.kl=k9"], "algo.kl"),
    ("kl-coef-without-kl", ["algo.kl_coef=0.1"], "algo.kl_coef"),
    ("dr-grpo-without-length", ["algo.reducer=dr_grpo"], "algo.max_response_len"),
    ("corrections-exclusive", ["algo.rollout_correction=tis+mis"], "algo.rollout_correction"),
    ("updates-zero", ["algo.updates_per_step=0"], "algo.updates_per_step"),
    ("updates-exceed-groups", ["algo.updates_per_step=3"], "algo.updates_per_step"),
    ("lr-zero", ["optim.lr=0"], "optim.lr"),
    ("beta1-above-1", ["optim.beta1=2"], "optim.beta1"),
    ("grad-clip-negative", ["optim.grad_clip=-1"], "optim.grad_clip"),
    ("lora-rank-zero", ["lora.rank=0"], "lora.rank"),
    ("lora-alpha-zero", ["lora.alpha=0"], "lora.alpha"),
    ("lora-dropout-one", ["lora.dropout=1.0"], "lora.dropout"),
    ("lora-targets-empty", ["lora.targets=[]"], "lora.targets"),
    ("lora-targets-bad-regex", ["lora.targets=['q_proj(']"], "lora.targets"),
    (
        "pipeline-split-sum",
        ["parallel.pp=2", "cluster.num_workers=2", "parallel.pp_layers=[1,2]"],
        "parallel: pp_layers: [1, 2] sum to 3, but the model has 6 layers",
    ),
    ("pipeline-more-stages-than-layers", ["parallel.pp=8", "cluster.num_workers=8"], "pp_layers"),
    (
        "experts-over-ep",
        ["parallel.ep=3", "parallel.dp=3", "cluster.num_workers=3", "rollout.prompts_per_step=3"],
        "num_experts=16 is not divisible by the expert-parallel size 3",
    ),
    ("ep-with-tp", ["parallel.ep=2", "parallel.tp=2", "cluster.num_workers=2"], "parallel.ep needs parallel.tp=1"),
    (
        "layout-world-mismatch",
        ["parallel.pp=2", "parallel.dp=2", "cluster.num_workers=2"],
        "cluster.num_workers must equal the layout's world size",
    ),
    ("tp-without-workers", ["parallel.tp=2"], "cluster.num_workers"),
    ("sp-without-tp", ["parallel.sp=true"], "parallel.sp"),
    ("device-unknown", ["cluster.device=tpu"], "cluster.device"),
    ("ray-address-local", ["cluster.ray_address=auto"], "cluster.ray_address"),
    ("on-failure-unknown", ["reward.on_failure=ignore"], "reward.on_failure"),
    ("timeout-zero", ["reward.timeout_s=0"], "reward.timeout_s"),
    ("remote-option-elsewhere", ["reward.url=http://x"], "reward.url"),
    ("remote-without-url", ["reward.fn=remote"], "reward.url"),
    ("max-steps-zero", ["trainer.max_steps=0"], "trainer.max_steps"),
    ("seed-beyond-64-bits", ["trainer.seed=100000000000000000000000"], "trainer.seed"),
    ("memory-beyond-host", ["rollout.memory_mb=1e12"], "rollout.memory_mb"),
    ("resume-missing-dir", ["trainer.resume=/no/such/checkpoint"], "trainer.resume"),
    ("wandb-unknown", ["logging.wandb=cloud"], "logging.wandb"),
    ("path-and-preset", ["model.preset=k3-small"], "model.path or preset"),
    ("preset-unknown", ["model=k3_small", "model.preset=k3-huge"], "model.preset"),
    ("hf-checkpoint-without-path", ["model=hf_checkpoint"], "model.path must be set"),
    ("data-suffix", ["data.path=prompts.csv"], "data.path"),
    ("system-prompt-without-template", ["data.system_prompt=hi"], "data.system_prompt"),
    # --- the environment ---
    ("cuda-without-gpu", ["cluster.device=cuda"], "cluster.device"),
    ("run-dir-under-a-file", ["hydra.run.dir={d}/a_file/run"], "hydra.run.dir"),
    ("run-dir-is-a-file", ["hydra.run.dir={d}/a_file"], "hydra.run.dir"),
    ("run-dir-in-proc", ["hydra.run.dir=/proc/miles-train/run"], "hydra.run.dir"),
    # --- LoRA targets against the model (its layout, no model built) ---
    ("targets-match-nothing", ["lora.targets=[nothing_here]"], "lora.targets"),
    ("one-target-is-a-typo", ["lora.targets=['q_proj$','qq_proj$']"], "'qq_proj$'"),
    # --- checkpoints (model.path) ---
    ("model-path-missing", ["model.path=/no/such/model"], "model.path"),
    ("config-not-json", ["model.path={d}/ckpt_config_garbage"], "config.json"),
    ("config-json-list", ["model.path={d}/ckpt_config_list"], "config.json"),
    ("config-unknown-model-type", ["model.path={d}/ckpt_config_llama"], "config.json"),
    ("tensor-missing", ["model.path={d}/ckpt_tensor_missing"], "model.norm.weight"),
    ("tensor-wrong-shape", ["model.path={d}/ckpt_tensor_shape"], "model.embed_tokens.weight"),
    ("safetensors-corrupt", ["model.path={d}/ckpt_corrupt"], "model.path"),
    ("safetensors-truncated", ["model.path={d}/ckpt_truncated"], "model.path"),
    ("no-safetensors", ["model.path={d}/ckpt_no_tensors"], "safetensors"),
    ("index-missing-shard", ["model.path={d}/ckpt_index_missing_shard"], "model.safetensors.index.json"),
    (
        "hf-tokenizer-missing",
        ["model=hf_checkpoint", "model.path={d}/hf_no_tokenizer", "data.path={d}/spaced.jsonl", "data.eval_path=null"],
        "model.tokenizer",
    ),
    (
        "tokenizer-not-the-models",
        ["model=hf_checkpoint", "model.path={d}/hf_vocab8", "data.path={d}/spaced.jsonl", "data.eval_path=null"],
        "outside the model's vocabulary (8)",
    ),
    # --- datasets (data.path, data.eval_path) ---
    ("data-missing", ["data.path=/no/such.jsonl"], "/no/such.jsonl"),
    ("data-not-jsonl", ["data.path={d}/csv_rows.jsonl"], "csv_rows.jsonl line 1"),
    ("data-binary", ["data.path={d}/binary.jsonl"], "binary.jsonl line 1"),
    ("data-row-without-prompt", ["data.path={d}/no_prompt.jsonl"], "no_prompt.jsonl line 2"),
    ("data-row-without-label", ["data.path={d}/no_label.jsonl"], "no_label.jsonl line 2"),
    ("data-null-label", ["data.path={d}/null_label.jsonl"], "null_label.jsonl line 1"),
    ("data-row-is-a-list", ["data.path={d}/list_row.jsonl"], "list_row.jsonl line 1"),
    ("data-empty", ["data.path={d}/empty.jsonl"], "empty.jsonl"),
    ("data-prompt-not-encodable", ["data.path={d}/letters.jsonl"], "letters.jsonl record 0"),
    ("data-prompt-too-long", ["data.path={d}/long.jsonl"], "long.jsonl record 0"),
    ("eval-data-bad-row", ["data.eval_path={d}/no_prompt.jsonl"], "data.eval_path"),
    ("parquet-garbage", ["data.path={d}/garbage.parquet"], "garbage.parquet"),
    (
        "drop-last-too-few-rows",
        ["data.path={d}/three_rows.jsonl", "data.drop_last=true", "rollout.prompts_per_step=4"],
        "data.drop_last",
    ),
    # --- reward plugins (reward.fn) ---
    ("plugin-module-missing", ["reward.fn=no_such_module:score"], "reward.fn"),
    ("plugin-attribute-missing", ["reward.fn=os.path:not_there"], "reward.fn"),
    ("plugin-import-fails", ["reward.fn=tests.cli.plugins.broken_import:score"], "reward.fn"),
    ("plugin-exits-on-import", ["reward.fn=tests.cli.plugins.exits_on_import:score"], "reward.fn"),
    ("plugin-not-callable", [f"reward.fn={PLUGINS}:NOT_CALLABLE"], "reward.fn"),
    ("plugin-signature", [f"reward.fn={PLUGINS}:two_arguments"], "reward.fn"),
    ("plugin-unknown-name", ["reward.fn=no.such.plugin"], "reward.fn"),
    # --- reward plugins that fail on the run's own samples (the model is built first) ---
    ("plugin-raises", [f"reward.fn={PLUGINS}:raises"], "reward.fn"),
    ("plugin-returns-text", [f"reward.fn={PLUGINS}:returns_text"], "reward.fn"),
    ("plugin-returns-nan", [f"reward.fn={PLUGINS}:returns_nan"], "reward.fn"),
    # --- resuming (trainer.resume): a checkpoint that does not fit this run ---
    ("resume-not-a-checkpoint", ["trainer.resume={d}"], "trainer.resume"),
    ("resume-other-world", ["trainer.resume={d}/resume_two_ranks/step_00000001"], "holds 2 trainer ranks"),
    ("resume-other-rank", ["trainer.resume={d}/resume_rank4/step_00000001"], "rank-4 adapter"),
    ("resume-other-modules", ["trainer.resume={d}/resume_q_only/step_00000001"], "lora.targets select"),
    ("resume-other-dataset", ["trainer.resume={d}/resume_other_data/step_00000001"], "dataset"),
    ("resume-manifest-files-list", ["trainer.resume={d}/resume_files_list/step_00000001"], "files must map"),
]
MID_RUN = {"plugin-raises", "plugin-returns-text", "plugin-returns-nan"}
SUBPROCESS = ["unknown-key", "run-dir-under-a-file", "cuda-without-gpu", "safetensors-corrupt", "plugin-raises"]


def _copy_asset(d: Path, name: str) -> Path:
    return Path(shutil.copytree(ASSET, d / name, ignore=shutil.ignore_patterns("*.jsonl", "README.md")))


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """Every malformed input, written once."""
    d = tmp_path_factory.mktemp("malformed")
    (d / "a_file").write_text("not a directory\n")
    (_copy_asset(d, "ckpt_config_garbage") / "config.json").write_text("{not json")
    (_copy_asset(d, "ckpt_config_list") / "config.json").write_text("[1, 2]")
    (_copy_asset(d, "ckpt_config_llama") / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tensors = load_file(str(ASSET / "model.safetensors"))
    norm = next(k for k in tensors if k.endswith("model.norm.weight"))  # stored names may carry a prefix
    save_file(
        {k: v for k, v in tensors.items() if k != norm},
        str(_copy_asset(d, "ckpt_tensor_missing") / "model.safetensors"),
    )
    emb = next(k for k in tensors if k.endswith("model.embed_tokens.weight"))
    save_file({**tensors, emb: torch.zeros(3, 3)}, str(_copy_asset(d, "ckpt_tensor_shape") / "model.safetensors"))
    (_copy_asset(d, "ckpt_corrupt") / "model.safetensors").write_bytes(os.urandom(4096))
    truncated = _copy_asset(d, "ckpt_truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    (_copy_asset(d, "ckpt_no_tensors") / "model.safetensors").unlink()
    index = _copy_asset(d, "ckpt_index_missing_shard")
    (index / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "shard-2.safetensors" for k in tensors}})
    )
    write_checkpoint(d / "hf_no_tokenizer", tokenizer=False)
    write_checkpoint(d / "hf_vocab8", vocab_size=8)  # the tokenizer's 19 ids do not fit
    write_prompts(d / "spaced.jsonl", spaced_arithmetic(4))
    (d / "csv_rows.jsonl").write_text("prompt,label\n1+1=,2\n")
    (d / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage\x80\n")
    write_prompts(d / "no_prompt.jsonl", [{"prompt": "1+1=", "label": 2}, {"question": "2+2=", "label": 4}])
    write_prompts(d / "no_label.jsonl", [{"prompt": "1+1=", "label": 2}, {"prompt": "2+2="}])
    write_prompts(d / "null_label.jsonl", [{"prompt": "1+1=", "label": None}])
    (d / "list_row.jsonl").write_text('["1+1=", 2]\n')
    (d / "empty.jsonl").write_text("")
    write_prompts(d / "letters.jsonl", [{"prompt": "x+y=", "label": 0}])
    write_prompts(d / "long.jsonl", [{"prompt": "1+" * 2500 + "1=", "label": 2501}])
    (d / "garbage.parquet").write_bytes(b"PAR1 this is not parquet")
    write_prompts(d / "three_rows.jsonl", [{"prompt": f"{i}+1=", "label": i + 1} for i in range(3)])
    (d / "small_train.jsonl").write_text("".join((ASSET / "train.jsonl").read_text().splitlines(True)[:64]))
    (d / "small_heldout.jsonl").write_text("".join((ASSET / "heldout.jsonl").read_text().splitlines(True)[:8]))
    config = K3Config.from_json_file(ASSET / "config.json")
    train = load_prompts(PromptDataConfig(path=str(d / "small_train.jsonl")))
    write_resume_checkpoint(d / "resume_two_ranks", config, train, workers=2)
    write_resume_checkpoint(d / "resume_rank4", config, train, rank=4)
    write_resume_checkpoint(d / "resume_q_only", config, train, targets=(r"self_attn\.q_proj$",))
    write_resume_checkpoint(d / "resume_other_data", config, train[:10])
    manifest = write_resume_checkpoint(d / "resume_files_list", config, train) / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "files": ["adapter", "trainer_state.pt"]}))
    return d


def _argv(case_overrides: list[str], d: Path, run_dir: Path) -> list[str]:
    """BASE, a small train / held-out split (reading 20,000 prompts per case would dominate the test's time)
    and the run directory, each unless the case sets that key itself, then the case's overrides."""
    overrides = [o.format(d=d) for o in case_overrides]
    defaults = [
        *BASE,
        f"data.path={d}/small_train.jsonl",
        f"data.eval_path={d}/small_heldout.jsonl",
        f"hydra.run.dir={run_dir}",
    ]
    mine = {o.split("=", 1)[0] for o in overrides}
    return [o for o in defaults if o.split("=", 1)[0] not in mine] + overrides


def _check(code: int, stderr: str, expected: str) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("miles-train: error: ") and expected in lines[0], lines[0]


def test_the_cases_cover_fifty_mistakes():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)
    assert MID_RUN | set(SUBPROCESS) <= {c[0] for c in CASES}


def _end_world() -> None:
    """The CLI starts its own torch.distributed world, as in the fresh process `miles-train` runs in: end
    one an earlier test of this process left running (`ensure_parallel` starts a new one on demand)."""
    import torch.distributed as dist

    from megatron_patches.parallel import destroy_parallel

    destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("case, overrides, expected", CASES, ids=[c[0] for c in CASES])
def test_in_process(bad, tmp_path, case, overrides, expected):
    if case in MID_RUN:
        _end_world()
    code, stderr = run_cli(*_argv(overrides, bad, tmp_path / "run"))
    _check(code, stderr, expected)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert (metrics.read_text() == "") if case in MID_RUN else not metrics.exists()  # not one row was logged


@pytest.mark.parametrize("case", SUBPROCESS)
def test_as_a_subprocess(bad, tmp_path, case):
    overrides, expected = next(c[1:] for c in CASES if c[0] == case)
    script = Path(sys.executable).with_name("miles-train")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "miles_k3.cli.train"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}  # the checkout under test
    out = subprocess.run(
        [*cmd, *_argv(overrides, bad, tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    _check(out.returncode, out.stderr, expected)
