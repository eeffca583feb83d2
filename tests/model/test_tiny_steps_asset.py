"""The shipped worked-solution base and its drafter (`miles_k3/assets/k3-tiny-steps`, made by
`scripts/train_tiny_base.py --task steps` and `scripts/train_drafter.py`).

Catches a silently broken asset: a checkpoint or drafter that no longer loads, prompt files the data loader
rejects or that leak held-out problems into training, weights whose greedy accuracy moved away from what
the README records or whose outputs stopped being long, and a drafter under which greedy speculation no
longer reproduces plain decoding.
"""

import re
from pathlib import Path

import pytest
import torch

import miles_k3
from miles_k3.data import PromptDataConfig, load_prompts
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.checkpoint import load_state_dict
from miles_k3.tasks import ArithmeticTokenizer, check_answer, split_of
from miles_k3.tasks.worked import DIGITS, MAX_RESPONSE_TOKENS, OPS
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.model_runner import build_engine_model
from rollout.request import SamplingParams
from rollout.spec import SpecConfig

ASSET = Path(miles_k3.__file__).parent / "assets" / "k3-tiny-steps"
TOK = ArithmeticTokenizer()
FIRST_N = 64
TOLERANCE = 0.15  # 64 prompts: one binomial standard deviation is ~6 points at 50%
MAX_NEW = MAX_RESPONSE_TOKENS + 4  # the script's evaluation budget
SPEC_N = 16  # prompts decoded with speculation


def _records(name: str):
    return load_prompts(PromptDataConfig(path=str(ASSET / name), shuffle=False))


def _readme_value(key: str) -> float:
    m = re.search(rf"^{re.escape(key)}: ([0-9.]+)$", (ASSET / "README.md").read_text(), re.MULTILINE)
    assert m, f"{ASSET / 'README.md'} has no '{key}: <value>' line"
    return float(m.group(1))


def _engine(speculation=None) -> Engine:
    config = K3Config.from_json_file(ASSET / "config.json")
    model, _ = build_engine_model(config, load_state_dict(ASSET, config), quantize="none", dtype=torch.float32)
    return Engine(
        model,
        EngineConfig(memory_bytes=64 << 20, max_running=64, max_seq_len=128, overlap="off", speculation=speculation),
    )


def _greedy(engine: Engine, records):
    prompts = [TOK.encode(r.prompt, add_bos=True) for r in records]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=(TOK.eos_token_id,)) for _ in records
    ]
    return engine.generate(prompts, params)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # batched decode of a tiny model: on a shared 2-core machine a second intra-op thread made it ~10x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain():
    return _greedy(_engine(), _records("heldout.jsonl")[:FIRST_N])


def test_files_present_and_small():
    for name in (
        "config.json",
        "model.safetensors",
        "train.jsonl",
        "heldout.jsonl",
        "README.md",
        "drafter/config.json",
        "drafter/model.safetensors",
    ):
        assert (ASSET / name).is_file(), f"{name} missing from {ASSET}"
    assert sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file()) < 10e6


def test_checkpoint_is_a_k3_tiny_on_the_arithmetic_tokenizer():
    model = K3ForCausalLM.from_pretrained(ASSET)
    c = model.config
    assert {"kda", "mla"} <= set(c.layer_kinds) and c.attn_res_block_size > 0 and c.moe_latent_size is not None
    assert 1e6 <= c.num_parameters() <= 3e6
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    assert c.vocab_size >= TOK.vocab_size


@pytest.mark.parametrize("name, split", [("train.jsonl", "train"), ("heldout.jsonl", "heldout")])
def test_prompt_files_hold_the_task_mix(name, split):
    records = _records(name)
    assert len(records) >= (1000 if split == "train" else FIRST_N)
    for r in records:
        a, b, op = (r.metadata["metadata"][k] for k in ("a", "b", "op"))
        assert op in OPS and all(DIGITS[0] <= len(str(x)) <= DIGITS[1] for x in (a, b))
        assert r.prompt == f"{a}{op}{b}=" and r.label == (a + b if op == "+" else a - b)
        assert split_of(a, op, b) == split
    train = {r.prompt for r in _records("train.jsonl")}
    assert split == "train" or not train & {r.prompt for r in records}


def test_greedy_accuracy_matches_the_readme_and_outputs_are_long(plain):
    records = _records("heldout.jsonl")[:FIRST_N]
    texts = [TOK.decode(c.output_ids) for c in plain]
    accuracy = sum(check_answer(t, r.label) for t, r in zip(texts, records)) / FIRST_N
    recorded = _readme_value(f"heldout_accuracy_first{FIRST_N}")
    assert abs(accuracy - recorded) <= TOLERANCE, (
        f"greedy accuracy on the first {FIRST_N} held-out prompts is {accuracy:.3f}; the README records {recorded:.3f}"
    )
    # long, well-formed outputs (what speculation wins on): most responses stop at eos after a full solution
    lengths = [len(c.output_ids) for c in plain]
    assert sum(lengths) / len(lengths) >= 25
    assert sum(c.output_ids[-1:] == [TOK.eos_token_id] for c in plain) >= 0.9 * FIRST_N


def test_greedy_speculation_with_the_shipped_drafter_equals_plain_decoding(plain):
    spec = _engine(SpecConfig(drafter=str(ASSET / "drafter"), gamma=4))
    got = _greedy(spec, _records("heldout.jsonl")[:SPEC_N])
    for want, have in zip(plain[:SPEC_N], got):
        assert have.output_ids == want.output_ids
        assert torch.allclose(torch.tensor(have.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
    # the drafter is worth its cost on this target: well over one token per verify step
    assert spec.decoder.strategy.stats.mean_accepted >= 2.0
