"""HF checkpoints: exact round trips (dense, sharded, MXFP4 experts, VL wrapper) and clear errors."""

import json
from pathlib import Path

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


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_drop_tensor, "missing.*layers.2.self_attn.kv_b_proj.weight"),
        (_narrow_tensor, r"layers.0.self_attn.o_proj.weight.*shape \(128, 127\)"),
        (_add_zero_point, "unknown quantization.*weight_zero_point"),
        (_quantize_without_config, "no compressed-tensors quantization_config"),
    ],
    ids=["missing", "wrong-shape", "unknown-quantization", "quantized-without-config"],
)
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


# ------------------------------------------------------------------ the published K3 layout, written by hand
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _published_tiny_config() -> dict:
    """The published K3 config.json (tests/model/fixtures) shrunk to a few layers, every K3 feature on."""
    d = json.loads((Path(__file__).parent / "fixtures" / "kimi_k3_config.json").read_text())
    t = d["text_config"]
    t.update(
        hidden_size=64,
        vocab_size=96,
        num_hidden_layers=4,
        intermediate_size=96,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        attn_res_block_size=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    t["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2, head_dim=16)
    d.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, media_placeholder_token_id=95)
    return d


def _random_mxfp4(g: torch.Generator, out: int, inp: int):
    """Valid packed E2M1 codes (two per byte, low nibble first) and E8M0 scales, and their value decoded here."""
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scale = torch.randint(122, 130, (out, inp // 32), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sign = torch.where(codes >= 8, -1.0, 1.0)
    value = sign * E2M1[(codes & 7).long()] * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
    return packed, scale, value


def test_a_checkpoint_in_the_published_k3_layout_loads_and_matches_the_reference(tmp_path):
    """Written the way K3 ships: `language_model.` text weights in bf16, routed experts' w1/w2/w3 packed MXFP4
    while routed_expert_down/up_proj stay bf16, A_log fp32 [head_dim] with the heads zero-padded, the vision
    tower and projector unprefixed beside them; the config is the published schema."""
    from miles_k3.model.layout import tensor_shapes

    d = _published_tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(d))
    config = K3Config.from_json_file(tmp_path / "config.json")
    g = torch.Generator().manual_seed(0)
    files, dense = {}, {}
    for name, shape in tensor_shapes(config).items():
        stored = "language_model." + name
        if ".experts." in name:
            packed, scale, value = _random_mxfp4(g, *shape)
            files[stored.replace(".weight", ".weight_packed")] = packed
            files[stored.replace(".weight", ".weight_scale")] = scale
            dense[name] = value
        elif name.endswith("A_log"):
            a = torch.zeros(16)
            a[:2] = torch.rand(2, generator=g) * 2
            files[stored], dense[name] = a, a.clone()
        elif name.endswith(("gate.weight", "e_score_correction_bias", "dt_bias")):
            files[stored] = torch.randn(shape, generator=g) * 0.1
            dense[name] = files[stored].clone()
        else:
            files[stored] = (torch.randn(shape, generator=g) * 0.1 + ("norm" in name)).to(torch.bfloat16)
            dense[name] = files[stored].float()
    files["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.randn(12, 8, generator=g).to(torch.bfloat16)
    files["mm_projector.proj.0.weight"] = torch.randn(8, 8, generator=g).to(torch.bfloat16)
    assert (
        files["language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj.weight"].dtype == torch.bfloat16
    )
    save_file(files, str(tmp_path / "model.safetensors"))

    loaded = K3ForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config == config and config.experts_mxfp4 and config.vl_wrapper
    ref = K3ForCausalLM(config).eval()
    ref.load_state_dict(dense, strict=True)
    ids = torch.randint(3, 96, (2, 9), generator=g)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref(ids).logits)
    # and it writes back the same config.json (vision and media keys included) and tensor names, less the vision
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == d
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert set(again) == {k for k in files if k.startswith("language_model.")}


@pytest.mark.parametrize("layout", [(1, 1, 4, 1), (4,), (40,)], ids=["kimi-linear", "unpadded", "padded-longer"])
def test_a_log_loads_from_either_published_layout(saved, layout):
    path, tensors = saved
    name = f"{P}.0.self_attn.A_log"
    heads = tensors[name][:4].clone()
    stored = torch.full(layout, 9.0)
    stored.view(-1)[:4] = heads
    tensors[name] = stored
    save_file(tensors, path / "model.safetensors")
    a_log = K3ForCausalLM.from_pretrained(path).state_dict()["model.layers.0.self_attn.A_log"]
    assert a_log.shape == (32,) and torch.equal(a_log[:4], heads) and torch.all(a_log[4:] == 0)


def test_an_a_log_of_no_layout_is_named(saved):
    path, tensors = saved
    tensors[f"{P}.0.self_attn.A_log"] = torch.zeros(2, 2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers.0.self_attn.A_log.*no A_log layout for 4 heads"):
        K3ForCausalLM.from_pretrained(path)


def test_an_unprefixed_tensor_that_is_not_vision_is_named(saved):
    path, tensors = saved
    tensors["model.norm.weight"] = torch.ones(128)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.norm.weight'.*prefixed 'language_model.'"):
        K3ForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_corrupt_safetensors_file_is_named(saved, damage):
    path, _ = saved
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(
        {"garbage": b"\x00\x01not a safetensors file" * 10, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    )
    with pytest.raises(ValueError, match="model.safetensors"):
        K3ForCausalLM.from_pretrained(path)


def test_a_garbage_index_is_named(saved):
    path, _ = saved
    (path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(ValueError, match="model.safetensors.index.json: not a safetensors index"):
        K3ForCausalLM.from_pretrained(path)
