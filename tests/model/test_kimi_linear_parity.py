"""Logits equal transformers' KimiLinearForCausalLM on the same random weights (fp32, rel err <= 1e-4)."""

import pytest
import torch

from miles_k3.model import DenseStateCache, K3ForCausalLM
from tests.model.kimi_linear_oracle import random_kimi_linear

SHAPES = [
    dict(),
    dict(
        hidden=48,
        layers=5,
        heads=4,
        head_dim=12,
        kda_heads=3,
        kda_head_dim=16,
        experts=8,
        top_k=3,
        q_lora_rank=24,
        seed=1,
    ),
    dict(layers=8, experts=8, top_k=2, n_group=4, topk_group=2, seed=2, shared=2),
]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", SHAPES, ids=[f"shape{i}" for i in range(len(SHAPES))])
@pytest.mark.parametrize("seq_len", [7, 70])
def test_logits_match_transformers(tmp_path, shape, seq_len):
    oracle = random_kimi_linear(tmp_path, **shape)
    ours = K3ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    with torch.no_grad():
        want = oracle(ids).logits
        got = ours(ids).logits
    assert rel_err(got, want) <= 1e-4


def test_incremental_decode_matches_transformers_full_forward(tmp_path):
    oracle = random_kimi_linear(tmp_path, layers=5, seed=4)
    ours = K3ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = oracle(ids).logits
        cache = DenseStateCache(ours.config)
        steps = [ours(ids[:, :5], cache).logits]
        steps += [ours(ids[:, t : t + 1], cache).logits for t in range(5, 12)]
    assert rel_err(torch.cat(steps, dim=1), want) <= 1e-4


def test_saved_kimi_linear_loads_back_into_transformers(tmp_path):
    from transformers import KimiLinearForCausalLM

    oracle = random_kimi_linear(tmp_path / "hf", seed=5)
    ours = K3ForCausalLM.from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    reloaded = KimiLinearForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(reloaded(ids).logits, oracle(ids).logits) <= 1e-6


def test_tied_config_with_different_lm_head_is_rejected(tmp_path):
    random_kimi_linear(tmp_path, layers=3, tie=True, seed=3)  # transformers stores an untied lm_head anyway
    with pytest.raises(ValueError, match="lm_head.weight"):
        K3ForCausalLM.from_pretrained(tmp_path)
