"""The error boundary of every command, through the real console scripts: each user mistake below, given to
`miles-train`, `miles-k3 generate / plan / info` or `miles-serve` as a subprocess, exits with status 2 and
exactly one line on stderr ("<prog>: error: ...") that names the flag, key, file or row, with no traceback,
and changes no input file (every file under the inputs' directory is hashed before and after).

Nearly every mistake is refused before a model is built, so each process lives about two seconds; they run
two at a time (`RESULTS`, once per module) and each case's test only reads its result.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_k3.data import PromptDataConfig, load_prompts
from miles_k3.model import K3Config
from miles_k3.trainer import checkpoint as ckpt
from tests.cli.fixtures import ONE_SMALL_STEP, write_prompts, write_resume_checkpoint

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "miles_k3" / "assets"
ARITH = ASSETS / "k3-tiny-arith"
BIN = Path(sys.executable).parent
TRAIN = [
    *ONE_SMALL_STEP,
    "data.path={d}/small_train.jsonl",
    "data.eval_path={d}/small_heldout.jsonl",
]
GEN = ["generate", "--model", "builtin:k3-tiny-arith", "--max-new-tokens", "2"]
SERVE = ["--model", "builtin:k3-tiny-arith", "--port", "0"]
GEN_TP2 = [
    "generate",
    "--tokenizer",
    "arithmetic",
    "--input-ids",
    "{d}/ids.jsonl",
    "--max-new-tokens",
    "2",
    "--tp",
    "2",
]
HOST_MB = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
STEP = "step_00000001"

# (case id, command, arguments ({d}: the inputs' directory), text the one line must contain)
CASES = [
    # --- miles-train: composition (Hydra, YAML), values, plugins ---
    ("train-plus-unknown-key", "miles-train", [*TRAIN, "+trainer.extra_key=1"], "trainer.extra_key"),
    ("train-plus-unknown-nested", "miles-train", [*TRAIN, "+rollout.speculative.x=1"], "rollout.speculative.x"),
    ("train-unknown-flag", "miles-train", [*TRAIN, "--bogus"], "--bogus"),
    ("train-seed-beyond-64-bits", "miles-train", [*TRAIN, "trainer.seed=100000000000000000000000"], "trainer.seed"),
    ("train-seed-negative", "miles-train", [*TRAIN, "trainer.seed=-1"], "trainer.seed"),
    ("train-memory-beyond-host", "miles-train", [*TRAIN, "rollout.memory_mb=1e12"], "rollout.memory_mb"),
    ("train-recipe-yaml-garbage", "miles-train", ["--config-dir={d}/conf", "recipe=bad", *TRAIN[1:]], "bad.yaml"),
    (
        "train-config-dir-prechecked",
        "miles-train",
        ["--config-dir={d}/conf", *TRAIN, "trainer.max_stepz=1"],
        "max_stepz",
    ),
    ("train-config-dir-missing", "miles-train", ["--config-dir={d}/no_such_dir", *TRAIN], "--config-dir"),
    (
        "train-plugin-sys-exit",
        "miles-train",
        [*TRAIN, "reward.fn=tests.cli.plugins.exits_on_import:score"],
        "reward.fn",
    ),
    ("train-drafter-not-json", "miles-train", [*TRAIN, "rollout.speculative.drafter={d}/drafter_bad"], "config.json"),
    (
        "train-truncated-png",
        "miles-train",
        [*TRAIN, "recipe=k3_grpo_squares", "data.path={d}/truncated_png.jsonl", "data.eval_path=null"],
        "truncated_png.jsonl record 0",
    ),
    # --- miles-train: tampered checkpoints given to trainer.resume ---
    ("resume-garbage-state", "miles-train", [*TRAIN, f"trainer.resume={{d}}/r_garbage/{STEP}"], "trainer_state.pt"),
    ("resume-state-without-workers", "miles-train", [*TRAIN, f"trainer.resume={{d}}/r_noworkers/{STEP}"], "'workers'"),
    ("resume-worker-not-a-state", "miles-train", [*TRAIN, f"trainer.resume={{d}}/r_badworker/{STEP}"], "workers[0]"),
    ("resume-manifest-files-list", "miles-train", [*TRAIN, f"trainer.resume={{d}}/r_fileslist/{STEP}"], "files"),
    ("resume-adapter-wrong-shape", "miles-train", [*TRAIN, f"trainer.resume={{d}}/r_shape/{STEP}"], "lora_A"),
    ("resume-adapter-nan", "miles-train", [*TRAIN, f"trainer.resume={{d}}/r_nan/{STEP}"], "non-finite"),
    # --- miles-k3 generate: rows, flags, outputs ---
    ("gen-unknown-role", "miles-k3", [*GEN, "--prompts", "{d}/role.jsonl"], "role.jsonl line 1: messages[0].role"),
    ("gen-empty-messages", "miles-k3", [*GEN, "--prompts", "{d}/no_messages.jsonl"], "no_messages.jsonl line 1"),
    ("gen-no-content", "miles-k3", [*GEN, "--prompts", "{d}/no_content.jsonl"], "messages[0].content"),
    ("gen-int-content", "miles-k3", [*GEN, "--prompts", "{d}/int_content.jsonl"], "messages[0].content"),
    ("gen-message-not-object", "miles-k3", [*GEN, "--prompts", "{d}/str_message.jsonl"], "messages[1]"),
    ("gen-empty-prompt", "miles-k3", [*GEN, "--prompts", "{d}/empty_prompt.jsonl"], "empty_prompt.jsonl line 2"),
    ("gen-stop-outside-vocab", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--stop-token-id", "999"], "999"),
    ("gen-seed-beyond-64-bits", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--seed", str(2**70)], "--seed"),
    ("gen-memory-beyond-host", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--memory-mb", "1e9"], "--memory-mb"),
    ("gen-memory-holds-no-slot", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--memory-mb", "0.001"], "--memory-mb"),
    ("gen-row-beyond-the-pool", "miles-k3", [*GEN, "--prompts", "{d}/long.jsonl", "--memory-mb", "0.2"], "row 1"),
    ("gen-max-seq-len-1", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--max-seq-len", "1"], "--max-seq-len"),
    ("gen-tp-3", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--tp", "3"], "--tp"),
    ("gen-adapter-nan", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--adapter", "{d}/adapter_nan"], "--adapter"),
    (
        "gen-drafter-not-json",
        "miles-k3",
        [*GEN, "--prompts", "{d}/p.jsonl", "--speculative", "dspark", "--drafter", "{d}/drafter_bad"],
        "drafter_bad/config.json",
    ),
    ("gen-json-is-the-prompts", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--json", "{d}/p.jsonl"], "--prompts"),
    ("gen-json-is-the-ids", "miles-k3", [*GEN, "--input-ids", "{d}/ids.jsonl", "--json", "{d}/ids.jsonl"], "--json"),
    ("gen-json-is-a-dir", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--json", "{d}/a_dir"], "--json"),
    ("gen-json-unwritable", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--json", "/proc/x/out.json"], "--json"),
    ("gen-json-under-a-file", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--json", "{d}/p.jsonl/o"], "--json"),
    ("gen-unknown-flag", "miles-k3", [*GEN, "--prompts", "{d}/p.jsonl", "--bogus"], "--bogus"),
    # only the --tp workers read the weights: their error comes back as the same one line, naming the rank
    ("gen-tp2-weights-truncated", "miles-k3", [*GEN_TP2, "--model", "{d}/tp_weights"], "--tp rank 0: "),
    (
        "gen-tp2-memory-beyond-host",
        "miles-k3",
        [*GEN_TP2, "--model", "builtin:k3-tiny-arith", "--memory-mb", str(int(HOST_MB * 0.6))],
        "x --tp 2 =",
    ),
    # --- miles-k3 plan / info ---
    ("plan-memory-inf", "miles-k3", ["plan", "--preset", "k3-tiny", "--gpus", "1", "--gpu-memory-gb", "inf"], "inf"),
    ("plan-memory-nan", "miles-k3", ["plan", "--preset", "k3-tiny", "--gpus", "1", "--gpu-memory-gb", "nan"], "nan"),
    (
        "plan-tp3-on-3-gpus",
        "miles-k3",
        ["plan", "--preset", "k3-tiny", "--gpus", "3", "--gpu-memory-gb", "80", "--layout", "tp=3"],
        "--layout: no layout builds this model",
    ),
    (
        "plan-engine-dcp-3-of-tp-2",
        "miles-k3",
        ["plan", "--preset", "k3-tiny", "--gpus", "2", "--gpu-memory-gb", "80", "--engine-layout", "tp=2,dcp=3"],
        "--engine-layout 'tp=2,dcp=3'",
    ),
    ("info-config-not-json", "miles-k3", ["info", "--config", "{d}/not_json.json"], "not_json.json"),
    ("info-config-missing", "miles-k3", ["info", "--config", "{d}/no_such.json"], "--config"),
    ("info-preset-unknown", "miles-k3", ["info", "--preset", "k3-huge"], "--preset"),
    # --- miles-serve ---
    ("serve-max-seq-len-1", "miles-serve", [*SERVE, "--max-seq-len", "1"], "--max-seq-len"),
    ("serve-host-256", "miles-serve", [*SERVE, "--host", "256.1.1.1"], "--host 256.1.1.1"),
    ("serve-memory-beyond-host", "miles-serve", [*SERVE, "--memory-mb", "1e9"], "--memory-mb"),
    ("serve-memory-holds-no-slot", "miles-serve", [*SERVE, "--memory-mb", "0.001"], "--memory-mb 0.001"),
    ("serve-port-out-of-range", "miles-serve", [*SERVE, "--port", "70000"], "--port"),
    ("serve-adapter-nan", "miles-serve", [*SERVE, "--adapter", "p={d}/adapter_nan"], "--adapter"),
    (
        "serve-drafter-not-json",
        "miles-serve",
        [*SERVE, "--speculative", "dspark", "--drafter", "{d}/drafter_bad"],
        "drafter_bad/config.json",
    ),
    ("serve-adapter-no-name", "miles-serve", [*SERVE, "--adapter", "{d}/adapter_nan"], "--adapter"),
    ("serve-unknown-flag", "miles-serve", [*SERVE, "--bogus"], "--bogus"),
    ("serve-max-loras-without-a-pool", "miles-serve", [*SERVE, "--max-loras", "2"], "--max-lora-rank"),
    ("serve-lora-rank-0", "miles-serve", [*SERVE, "--max-lora-rank", "0"], "--max-lora-rank"),
]


def _rehash(step_dir: Path) -> None:
    """Rewrite the checkpoint's manifest over its files as they are now: a tampered file that verifies."""
    files = {}
    for p in sorted(q for q in step_dir.rglob("*") if q.is_file() and q.name != ckpt.MANIFEST):
        files[p.relative_to(step_dir).as_posix()] = {"bytes": p.stat().st_size, "sha256": ckpt._sha256(p)}
    (step_dir / ckpt.MANIFEST).write_text(json.dumps({"step": 1, "files": files}))


def _tamper_adapter(step_dir: Path, change) -> None:
    path = step_dir / ckpt.ADAPTER_DIR / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = change(tensors[key])
    save_file(tensors, str(path))
    _rehash(step_dir)


def _tamper_state(step_dir: Path, change) -> None:
    path = step_dir / ckpt.STATE_FILE
    state = torch.load(path, weights_only=False)
    torch.save(change(state), path)
    _rehash(step_dir)


def _inputs(d: Path) -> None:
    """Every malformed input the cases read, under d."""
    (d / "conf" / "recipe").mkdir(parents=True)
    (d / "conf" / "recipe" / "bad.yaml").write_text("defaults:\n  - k3_grpo\n  foo: [1,\n")
    (d / "small_train.jsonl").write_text("".join((ARITH / "train.jsonl").read_text().splitlines(True)[:16]))
    (d / "small_heldout.jsonl").write_text("".join((ARITH / "heldout.jsonl").read_text().splitlines(True)[:4]))
    drafter = Path(shutil.copytree(ASSETS / "k3-tiny-steps" / "drafter", d / "drafter_bad"))
    (drafter / "config.json").write_text("{not json")
    row = json.loads((ASSETS / "k3-tiny-vl-squares" / "train.jsonl").read_text().splitlines()[0])
    png = base64.b64decode(row["images"][0].split(",", 1)[1])
    row["images"] = ["data:image/png;base64," + base64.b64encode(png[: len(png) * 2 // 3]).decode()]
    write_prompts(d / "truncated_png.jsonl", [row])
    write_prompts(d / "p.jsonl", [{"prompt": "1+1="}])
    write_prompts(d / "long.jsonl", [{"prompt": "1+" * 300 + "1="}])
    write_prompts(d / "ids.jsonl", [{"input_ids": [1, 5, 6]}])
    write_prompts(d / "role.jsonl", [{"messages": [{"role": "bot", "content": "1+1="}]}])
    write_prompts(d / "no_messages.jsonl", [{"messages": []}])
    write_prompts(d / "no_content.jsonl", [{"messages": [{"role": "user"}]}])
    write_prompts(d / "int_content.jsonl", [{"messages": [{"role": "user", "content": 7}]}])
    write_prompts(d / "str_message.jsonl", [{"messages": [{"role": "user", "content": "1+1="}, "2"]}])
    write_prompts(d / "empty_prompt.jsonl", [{"prompt": "1+1="}, {"prompt": ""}])
    (d / "not_json.json").write_text("{not json")
    (d / "a_dir").mkdir()
    (d / "tp_weights").mkdir()  # config.json reads, the weights' header is cut short
    shutil.copy(ARITH / "config.json", d / "tp_weights" / "config.json")
    weights = (ARITH / "model.safetensors").read_bytes()
    (d / "tp_weights" / "model.safetensors").write_bytes(weights[: len(weights) // 2])

    config = K3Config.from_json_file(ARITH / "config.json")
    train = load_prompts(PromptDataConfig(path=str(d / "small_train.jsonl")))
    for name in ("r_garbage", "r_noworkers", "r_badworker", "r_fileslist", "r_shape", "r_nan"):
        write_resume_checkpoint(d / name, config, train)
    (d / "r_garbage" / STEP / ckpt.STATE_FILE).write_bytes(os.urandom(2048))
    _rehash(d / "r_garbage" / STEP)
    _tamper_state(d / "r_noworkers" / STEP, lambda s: {k: v for k, v in s.items() if k != "workers"})
    _tamper_state(d / "r_badworker" / STEP, lambda s: {**s, "workers": ["not a state"]})
    manifest = json.loads((d / "r_fileslist" / STEP / ckpt.MANIFEST).read_text())
    manifest["files"] = list(manifest["files"])
    (d / "r_fileslist" / STEP / ckpt.MANIFEST).write_text(json.dumps(manifest))
    _tamper_adapter(d / "r_shape" / STEP, lambda t: torch.zeros(t.shape[0], t.shape[1] + 1))
    _tamper_adapter(d / "r_nan" / STEP, lambda t: torch.full_like(t, float("nan")))
    shutil.copytree(d / "r_nan" / STEP / ckpt.ADAPTER_DIR, d / "adapter_nan")


def _snapshot(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()
    }


def _run(case: tuple, d: Path, cwd: Path) -> subprocess.CompletedProcess:
    name, command, args, _ = case
    script = BIN / command
    work = cwd / name
    work.mkdir()
    argv = [a.format(d=d) for a in args]
    if command == "miles-train":
        argv.append(f"hydra.run.dir={work}/run")
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=120, cwd=work, env=env)
    except subprocess.TimeoutExpired as e:  # a mistake that was accepted (a server now serving): a failed case
        return subprocess.CompletedProcess(e.cmd, -9, "", f"timed out after {e.timeout} s (the mistake was accepted)")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case run once, two processes at a time: (inputs before, inputs after, {case: process})."""
    d = tmp_path_factory.mktemp("inputs")
    _inputs(d)
    before = _snapshot(d)
    cwd = tmp_path_factory.mktemp("work")
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip([c[0] for c in CASES], pool.map(lambda c: _run(c, d, cwd), CASES)))
    return before, _snapshot(d), done


def test_the_cases_are_distinct_and_cover_every_command():
    assert len({c[0] for c in CASES}) == len(CASES)
    assert {c[1] for c in CASES} == {"miles-train", "miles-k3", "miles-serve"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_line_and_status_2(results, case):
    name, command, args, expected = case
    out = results[2][name]
    prog = command if command != "miles-k3" or args[0].startswith("-") else f"miles-k3 {args[0]}"
    lines = out.stderr.splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(("miles-k3: error: ", f"{prog}: error: ")) and expected in lines[0], lines[0]


def test_no_input_changed(results):
    before, after, _ = results
    assert after == before  # nothing written over, beside or into the inputs


def test_output_written_atomically(tmp_path, monkeypatch):
    """`write_atomically` renames a complete temporary file over the target; when the write fails the
    target is untouched and no temporary file is left in its directory."""
    from miles_k3.errors import write_atomically

    target = tmp_path / "out.json"
    target.write_text("old")
    write_atomically(target, "new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        write_atomically(target, "newer")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_tp_worker_error_names_the_file(results):
    line = results[2]["gen-tp2-weights-truncated"].stderr.strip()
    assert "tp_weights/model.safetensors: not a readable safetensors file" in line, line


def _fail_on_rank(rank: int, world: int, port: int, failing: int, error: str) -> None:
    """A spawned rank (`spawn_ranks`) of a gloo world: rank `failing` raises `error`'s exception, the others
    wait for it in a collective."""
    import torch.distributed as dist

    from megatron_patches.parallel import end_world

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if rank == failing:
            if error == "mistake":
                raise FileNotFoundError(2, "No such file or directory", "/ckpt/model-00002.safetensors")
            raise KeyError("a bug")
        dist.barrier()
    finally:
        end_world()


@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed")
@pytest.mark.parametrize("error", ["mistake", "bug"])
def test_one_rank_failing_alone_ends_every_rank_and_names_it(tmp_path, error):
    """What no parent check sees and only one rank meets (a rank whose own slice of the weights cannot be
    read; a bug on one rank) ends the other ranks, which wait for it in a collective, instead of hanging
    them: a mistake comes back as one line naming the rank and the file, a bug as its type and traceback."""
    from megatron_patches.parallel import free_port
    from miles_k3.cli.generate import spawn_ranks
    from miles_k3.errors import user_error

    with pytest.raises((ValueError, RuntimeError)) as caught:
        spawn_ranks(_fail_on_rank, 3, (free_port(), 1, error), tmp_path)
    message = str(caught.value)
    if error == "mistake":
        assert user_error(caught.value) == "--tp rank 1: /ckpt/model-00002.safetensors: No such file or directory"
    else:
        assert user_error(caught.value) is None  # a bug keeps its traceback, the rank's
        assert message.startswith("--tp rank 1: KeyError: 'a bug'\n") and "in _fail_on_rank" in message
