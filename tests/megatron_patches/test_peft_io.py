"""PEFT export / import: bit-exact round trip, files the `peft` library loads, clear errors."""

import copy
import json

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_patches.lora import adapter_state, load_adapter_state
from megatron_patches.model import build_policy
from miles_k3.model.lora_spec import LoraSpec
from miles_k3.model.peft import CONFIG_FILE, WEIGHTS_FILE, load_peft, save_peft
from tests.megatron_patches.common import CONFIG, random_like, reference, token_ids

# Everything but routed experts: PEFT wraps nn.Linear modules, and K3's reference holds experts stacked.
LINEAR_TARGETS = (
    r"self_attn\.(q|k|v|o|g|q_b|kv_b)_proj$",
    r"mlp\.(gate|up|down)_proj$",
    r"shared_experts\.(gate|up|down)_proj$",
    r"routed_expert_(down|up)_proj$",
)


@pytest.fixture(scope="module")
def ref():
    return reference()


def _adapter(ref, spec, seed=1, dtype=torch.float32):
    policy = build_policy(CONFIG, ref.state_dict(), spec, dtype=dtype)
    tensors = random_like(adapter_state(policy), seed=seed)
    load_adapter_state(policy, tensors)
    return policy.eval(), tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(ref, tmp_path, dtype):
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.05)
    _, tensors = _adapter(ref, spec, dtype=dtype)
    save_peft(tmp_path / "a", tensors, spec)
    back, spec2 = load_peft(tmp_path / "a")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == dtype and torch.equal(back[k], tensors[k]) for k in tensors)
    assert (spec2.rank, spec2.alpha, spec2.dropout) == (spec.rank, spec.alpha, spec.dropout)
    # the returned spec targets exactly the adapted modules of this model
    rebuilt = build_policy(CONFIG, ref.state_dict(), spec2, dtype=dtype)
    load_adapter_state(rebuilt, back)
    # per-expert PEFT names for the stacked routed experts
    keys = load_file(str(tmp_path / "a" / WEIGHTS_FILE)).keys()
    assert "base_model.model.model.layers.1.block_sparse_moe.experts.3.w2.lora_B.weight" in keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys


def test_peft_library_loads_it_and_computes_the_policy(ref, tmp_path):
    """PEFT's own LoRA layers, injected into the reference model from our files, give the policy's logits."""
    spec = LoraSpec(rank=4, alpha=8.0, targets=LINEAR_TARGETS)
    policy, tensors = _adapter(ref, spec)
    save_peft(tmp_path / "a", tensors, spec)
    config = peft.LoraConfig.from_pretrained(str(tmp_path / "a"))
    assert (config.r, config.lora_alpha, config.peft_type) == (4, 8.0, peft.PeftType.LORA)
    model = peft.inject_adapter_in_model(config, copy.deepcopy(ref))
    result = peft.set_peft_model_state_dict(model, peft.utils.load_peft_weights(str(tmp_path / "a")))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    ids = token_ids()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, policy(ids).logits, atol=1e-5, rtol=1e-5)


def test_save_replaces_atomically_and_keeps_other_files(ref, tmp_path):
    spec = LoraSpec(rank=2)
    _, first = _adapter(ref, spec, seed=1)
    _, second = _adapter(ref, spec, seed=2)
    save_peft(tmp_path / "a", first, spec)
    (tmp_path / "a" / "README.md").write_text("notes")
    save_peft(tmp_path / "a", second, spec)
    back, _ = load_peft(tmp_path / "a")
    assert all(torch.equal(back[k], second[k]) for k in second)
    assert (tmp_path / "a" / "README.md").read_text() == "notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary directory left behind


def _write(tmp_path, ref, mutate_config=None, mutate_weights=None):
    spec = LoraSpec(rank=2)
    _, tensors = _adapter(ref, spec)
    d = tmp_path / "a"
    save_peft(d, tensors, spec)
    if mutate_config:
        cfg = json.loads((d / CONFIG_FILE).read_text())
        mutate_config(cfg)
        (d / CONFIG_FILE).write_text(json.dumps(cfg))
    if mutate_weights:
        w = load_file(str(d / WEIGHTS_FILE))
        mutate_weights(w)
        save_file(w, str(d / WEIGHTS_FILE))
    return d


def _drop(key):
    return lambda d: d.pop(key)


def _first_expert_gone(w):
    for k in [k for k in w if ".experts.0.w1.lora_A" in k]:
        w.pop(k)


def _rename_first(w):
    k = sorted(w)[0]
    w["base_model.model.model.layers.0.oops"] = w.pop(k)


def _reshape_first_a(w):
    k = next(k for k in sorted(w) if k.endswith("lora_A.weight") and ".experts." not in k)
    w[k] = torch.zeros(3, w[k].shape[1])


@pytest.mark.parametrize(
    "mutate_config, mutate_weights, msg",
    [
        (_drop("r"), None, "missing 'r'"),
        (lambda c: c.update(r=0), None, "LoraSpec.rank"),
        (lambda c: c.update(peft_type="IA3"), None, "not LORA"),
        (lambda c: c.update(use_rslora=True), None, "use_rslora"),
        (lambda c: c.update(rank_pattern={"q_proj": 4}), None, "q_proj.*r=4"),
        (None, _first_expert_gone, "experts"),
        (None, _rename_first, "unexpected tensor"),
        (None, _reshape_first_a, "r=2"),
        (None, lambda w: w.pop(sorted(k for k in w if ".experts." not in k)[0]), "has no lora_"),
    ],
)
def test_malformed_files_raise(ref, tmp_path, mutate_config, mutate_weights, msg):
    d = _write(tmp_path, ref, mutate_config, mutate_weights)
    with pytest.raises(ValueError, match=msg):
        load_peft(d)


def test_missing_and_broken_files_raise(tmp_path):
    with pytest.raises(ValueError, match=CONFIG_FILE):
        load_peft(tmp_path)
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_peft(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    with pytest.raises(ValueError, match=WEIGHTS_FILE):
        load_peft(tmp_path)
    (tmp_path / WEIGHTS_FILE).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read"):
        load_peft(tmp_path)


def test_save_rejects_bad_tensors(tmp_path):
    spec = LoraSpec(rank=2)
    with pytest.raises(ValueError, match="no adapter tensors"):
        save_peft(tmp_path / "a", {}, spec)
    with pytest.raises(ValueError, match="has no lora_B"):
        save_peft(tmp_path / "a", {"m.q_proj.lora_A": torch.zeros(2, 4)}, spec)
    with pytest.raises(ValueError, match="r=2"):
        save_peft(tmp_path / "a", {"m.q_proj.lora_A": torch.zeros(3, 4), "m.q_proj.lora_B": torch.zeros(4, 3)}, spec)
    assert not list(tmp_path.iterdir())


def test_module_prefix_for_the_vl_wrapper(ref, tmp_path):
    spec = LoraSpec(rank=2)
    _, tensors = _adapter(ref, spec)
    save_peft(tmp_path / "a", tensors, spec, module_prefix="language_model.")
    keys = load_file(str(tmp_path / "a" / WEIGHTS_FILE)).keys()
    assert all(k.startswith("base_model.model.language_model.model.") for k in keys)
    back, _ = load_peft(tmp_path / "a", module_prefix="language_model.")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_peft(tmp_path / "a", module_prefix="vision_tower.")
