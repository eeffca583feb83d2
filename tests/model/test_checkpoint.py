"""HF checkpoints: exact round trips (dense, sharded, MXFP4 experts, VL wrapper) and clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.checkpoint import as_stored
from miles_k3.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.from_preset("k3-tiny", **overrides)).eval()


IDS = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(0))


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    with torch.no_grad():
        assert torch.equal(a(IDS).logits, b(IDS).logits)


def test_round_trip_is_exact_with_vl_wrapper_prefix(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "ckpt")
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert all(k.startswith("language_model.") for k in stored)
    assert "text_config" in json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert_same_model(model, K3ForCausalLM.from_pretrained(tmp_path / "ckpt"))


def test_sharded_round_trip_writes_an_index(tmp_path):
    model = tiny(1)
    model.save_pretrained(tmp_path / "ckpt", max_shard_bytes=1 << 20)
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    assert_same_model(model, K3ForCausalLM.from_pretrained(tmp_path / "ckpt"))


def test_mxfp4_experts_round_trip(tmp_path):
    model = tiny(2, experts_mxfp4=True)
    model.save_pretrained(tmp_path / "a")
    stored = load_file(tmp_path / "a" / "model.safetensors")
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
    assert stored[f"{name}.weight_packed"].dtype == torch.uint8 and f"{name}.weight" not in stored
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "a")
    orig = model.state_dict()["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    want = dequantize_mxfp4(*quantize_mxfp4(orig), dtype=torch.float32)
    assert torch.equal(loaded.state_dict()["model.layers.1.block_sparse_moe.experts.3.w2.weight"], want)
    # quantization is idempotent: a second save writes the same bytes
    loaded.save_pretrained(tmp_path / "b")
    again = load_file(tmp_path / "b" / "model.safetensors")
    assert stored.keys() == again.keys() and all(torch.equal(stored[k], again[k]) for k in stored)
    with torch.no_grad():
        a, b = model(IDS).logits, loaded(IDS).logits
    assert 0 < ((a - b).norm() / a.norm()).item() < 0.1


def test_as_stored_equals_a_save_load_round_trip(tmp_path):
    model = tiny(2, experts_mxfp4=True)
    model.save_pretrained(tmp_path / "a")
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "a").state_dict()
    snapped = as_stored(model.state_dict(), model.config)
    assert snapped.keys() == loaded.keys() and all(torch.equal(snapped[k], loaded[k]) for k in loaded)
    assert as_stored(snapped, model.config).keys() == snapped.keys()
    assert all(torch.equal(v, snapped[k]) for k, v in as_stored(snapped, model.config).items())  # a fixed point
    dense = tiny(2)
    state = dense.state_dict()
    assert as_stored(state, dense.config) is state  # no MXFP4 experts: nothing to snap


def test_loads_bf16_keeping_router_and_gate_params_fp32(tmp_path):
    tiny(3).save_pretrained(tmp_path)
    model = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert sd["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32


def test_saving_into_an_existing_directory_keeps_foreign_files(tmp_path):
    tiny(4).save_pretrained(tmp_path, max_shard_bytes=1 << 20)
    (tmp_path / "tokenizer.json").write_text("{}")
    tiny(5).save_pretrained(tmp_path)  # one shard now: the stale shards and index must go
    assert (tmp_path / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.tmp-*"))
    assert_same_model(tiny(5), K3ForCausalLM.from_pretrained(tmp_path))


@pytest.fixture
def saved(tmp_path):
    tiny(6).save_pretrained(tmp_path)
    return tmp_path, load_file(tmp_path / "model.safetensors")


P = "language_model.model.layers"


def _drop_tensor(t):
    del t[f"{P}.2.self_attn.kv_b_proj.weight"]


def _narrow_tensor(t):
    t[f"{P}.0.self_attn.o_proj.weight"] = t[f"{P}.0.self_attn.o_proj.weight"][:, :-1].contiguous()


def _add_zero_point(t):
    t[f"{P}.1.block_sparse_moe.experts.0.w1.weight_zero_point"] = torch.zeros(1)


def _quantize_without_config(t):
    name = f"{P}.1.block_sparse_moe.experts.0.w1"
    t[f"{name}.weight_packed"], t[f"{name}.weight_scale"] = quantize_mxfp4(t.pop(f"{name}.weight"))


@pytest.mark.parametrize("corrupt, message", [
    (_drop_tensor, "missing.*layers.2.self_attn.kv_b_proj.weight"),
    (_narrow_tensor, r"layers.0.self_attn.o_proj.weight.*shape \(128, 127\)"),
    (_add_zero_point, "unknown quantization.*weight_zero_point"),
    (_quantize_without_config, "no compressed-tensors quantization_config"),
], ids=["missing", "wrong-shape", "unknown-quantization", "quantized-without-config"])
def test_bad_tensors_are_named(saved, corrupt, message):
    path, tensors = saved
    corrupt(tensors)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        K3ForCausalLM.from_pretrained(path)


def test_config_inconsistent_with_tensors_is_rejected(saved):
    path, _ = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not in the config's layout.*experts"):
        K3ForCausalLM.from_pretrained(path)


def test_empty_or_missing_pieces(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        K3ForCausalLM.from_pretrained(tmp_path)
    K3Config.from_preset("k3-tiny").to_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        K3ForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="shard files missing"):
        K3ForCausalLM.from_pretrained(tmp_path)
