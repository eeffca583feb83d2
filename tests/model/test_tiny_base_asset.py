"""The shipped tiny K3 base (`miles_k3/assets/k3-tiny-arith`, made by `scripts/train_tiny_base.py`).

Catches a silently broken asset: a checkpoint that no longer loads or lost a K3 feature, prompt files the
data loader rejects or that leak held-out problems into training, and weights whose greedy accuracy moved
away from what the asset's README records.
"""

import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import miles_k3
from miles_k3.data import PromptDataConfig, load_prompts
from miles_k3.model import K3ForCausalLM
from miles_k3.model.generate import greedy_generate
from miles_k3.tasks import ArithmeticTokenizer, check_answer, split_of

ASSET = Path(miles_k3.__file__).parent / "assets" / "k3-tiny-arith"
TOK = ArithmeticTokenizer()
FIRST_N = 64
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return K3ForCausalLM.from_pretrained(ASSET).eval()


def _records(name: str):
    return load_prompts(PromptDataConfig(path=str(ASSET / name), shuffle=False))


def _readme_value(key: str) -> float:
    m = re.search(rf"^{re.escape(key)}: ([0-9.]+)$", (ASSET / "README.md").read_text(), re.MULTILINE)
    assert m, f"{ASSET / 'README.md'} has no '{key}: <value>' line"
    return float(m.group(1))


def test_files_present_and_small():
    for name in ("config.json", "model.safetensors", "train.jsonl", "heldout.jsonl", "README.md"):
        assert (ASSET / name).is_file(), f"{name} missing from {ASSET}"
    assert (ASSET / "model.safetensors").stat().st_size < 10e6


def test_checkpoint_has_every_k3_feature(model):
    c = model.config
    assert {"kda", "mla"} <= set(c.layer_kinds)
    assert c.kda_gate_form == "lower_bound" and c.kda_output_gate == "full"  # K3's KDA gate and output gate
    assert c.mla_output_gate
    assert c.attn_res_block_size > 0  # Attention Residuals
    assert c.moe_latent_size is not None and c.moe_latent_norm  # LatentMoE
    assert any(c.is_moe_layer(i) for i in range(c.num_hidden_layers)) and c.num_shared_experts > 0
    assert c.hidden_act == "situ"
    assert 1e6 <= c.num_parameters() <= 3e6
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    assert c.vocab_size >= TOK.vocab_size


@pytest.mark.parametrize("name, split", [("train.jsonl", "train"), ("heldout.jsonl", "heldout")])
def test_prompt_files_load_with_the_task_keys(name, split):
    records = _records(name)
    assert len(records) >= (1000 if split == "train" else 64)
    for r in records:
        # write_jsonl's rows are {"prompt", "label", "metadata": {"a", "b", "op"}}; the loader's default
        # metadata_keys=None (the default) keeps every key but prompt and label
        assert set(r.metadata) == {"metadata"} and set(r.metadata["metadata"]) == {"a", "b", "op"}
        a, b, op = (r.metadata["metadata"][k] for k in ("a", "b", "op"))
        assert r.prompt == r.raw_prompt == f"{a}{op}{b}="
        assert isinstance(r.label, int) and check_answer(str(r.label), a + b if op == "+" else a - b)
        assert split_of(a, op, b) == split


def test_train_and_heldout_are_disjoint():
    train = {r.prompt for r in _records("train.jsonl")}
    heldout = [r.prompt for r in _records("heldout.jsonl")]
    assert len(set(heldout)) == len(heldout)
    assert not train & set(heldout)


def test_greedy_accuracy_matches_the_readme(model):
    records = _records("heldout.jsonl")[:FIRST_N]
    by_len = defaultdict(list)
    for r in records:
        by_len[len(r.prompt)].append(r)
    correct = knows = 0
    for group in by_len.values():
        ids = torch.tensor([TOK.encode(r.prompt, add_bos=True) for r in group])
        new_ids, _ = greedy_generate(model, ids, 6, eos_token_id=TOK.eos_token_id)
        for r, row in zip(group, new_ids):
            text = TOK.decode(row)
            correct += check_answer(text, r.label)
            first = re.match(r"\s*(-?\d+)", text)  # the answer before any trailing habit number
            knows += first is not None and int(first.group(1)) == r.label
    recorded = _readme_value(f"heldout_accuracy_first{FIRST_N}")
    assert abs(correct / FIRST_N - recorded) <= TOLERANCE, (
        f"greedy accuracy on the first {FIRST_N} held-out prompts is {correct / FIRST_N:.3f}; the asset README "
        f"records {recorded:.3f}"
    )
    # A base for RL: it knows some of the arithmetic (its first number is right 20-70% of the time) but its
    # habit (a trailing random number) costs it at least 15 points that a verifier reward can win back.
    assert 0.20 <= knows / FIRST_N <= 0.70, knows / FIRST_N
    assert knows / FIRST_N - correct / FIRST_N >= 0.15, (knows / FIRST_N, correct / FIRST_N)
