"""K3Config: presets, parameter counts, HF config.json round trips, validation errors."""

import json
import re
from pathlib import Path

import pytest

from miles_k3.model import K3Config, hybrid_layer_kinds

PRESETS = ["k3", "kimi-linear-48b-a3b", "k3-small", "k3-tiny"]


def test_k3_layer_pattern_matches_published_placement():
    kinds = K3Config.from_preset("k3").layer_kinds
    mla = [i + 1 for i, k in enumerate(kinds) if k == "mla"]
    assert len(kinds) == 93 and mla == list(range(4, 93, 4)) + [93]
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24


def test_k3_parameter_count_within_three_percent_of_2_8t():
    c = K3Config.from_preset("k3")
    assert abs(c.num_parameters() - 2.8e12) / 2.8e12 < 0.03
    assert 50e9 < c.num_active_parameters() < 200e9


def test_kimi_linear_48b_a3b_counts_match_its_name():
    c = K3Config.from_preset("kimi-linear-48b-a3b")
    assert 47e9 < c.num_parameters() < 50e9
    assert 2.5e9 < c.num_active_parameters() < 3.6e9


def test_small_and_tiny_sizes():
    assert 0.5e9 <= K3Config.from_preset("k3-small").num_parameters() <= 2e9
    assert 1e6 <= K3Config.from_preset("k3-tiny").num_parameters() <= 10e6


def test_parameter_count_by_hand_for_one_kda_layer():
    c = K3Config.from_preset("k3")
    d, hk, h = 7168, 96 * 128, 96
    kda = 3 * hk * d + 3 * hk * 4 + 128 * d + hk * 128 + 128 + hk + h * d + hk * d + 128 + d * hk
    import math

    from miles_k3.model.layout import layer_tensor_shapes

    got = sum(math.prod(s) for n, s in layer_tensor_shapes(c, 0).items() if n.startswith("self_attn."))
    assert got == kda


FIXTURE = Path(__file__).parent / "fixtures" / "kimi_k3_config.json"  # the published K3 config.json's values
# What the published file says that our writer cannot know: remote-code classes and the stored dtype.
NOT_WRITTEN = {
    "auto_map",
    "dtype",
    "text_config.auto_map",
    "text_config.dtype",
    "text_config.initializer_range",
    "text_config.use_cache",
}


def _flat(d: dict, at: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("quantization_config", "vision_config", "auto_map"):
            out.update(_flat(v, f"{at}{k}."))
        else:
            out[at + k] = v
    return out


def published() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", PRESETS)
def test_hf_config_round_trip(tmp_path, name):
    c = K3Config.from_preset(name)
    c.to_json_file(tmp_path / "config.json")
    d = json.loads((tmp_path / "config.json").read_text())
    text = d["text_config"] if c.vl_wrapper else d
    assert d["model_type"] == ("kimi_k3" if c.vl_wrapper else "kimi_linear")
    assert text["model_type"] == "kimi_linear"
    assert ("quantization_config" in text) == c.experts_mxfp4
    back = K3Config.from_json_file(tmp_path / "config.json")
    assert back == c and back.hf_wrapper_extras == c.hf_wrapper_extras


def test_k3_preset_writes_the_published_config_key_by_key(tmp_path):
    K3Config.from_preset("k3").to_json_file(tmp_path / "config.json")
    ours, theirs = _flat(json.loads((tmp_path / "config.json").read_text())), _flat(published())
    for key, value in theirs.items():
        if key not in NOT_WRITTEN:
            assert key in ours, key
            assert ours[key] == value, key
    assert set(ours) <= set(theirs)  # and nothing of our own


def test_published_config_reads_as_k3_with_every_feature_on():
    c = K3Config.from_hf_dict(published())
    assert c == K3Config.from_preset("k3")
    assert c.num_parameters() == 2_779_484_478_208  # 2.78T
    assert (c.kda_gate_form, c.kda_gate_lower_bound, c.kda_output_gate) == ("lower_bound", -5.0, "full")
    assert c.mla_output_gate and c.attn_res_block_size == 12 and c.hidden_act == "situ"
    assert (c.moe_latent_size, c.moe_latent_norm, c.shared_intermediate) == (3584, True, 6144)
    assert (c.situ_beta, c.situ_beta_lin, c.experts_mxfp4, c.vl_wrapper) == (4.0, 25.0, True, True)
    assert c.router_correction_bias and c.max_position_embeddings == 1048576
    from miles_k3.model.layout import tensor_shapes

    shapes = tensor_shapes(c)
    assert shapes["model.layers.0.self_attn.A_log"] == (128,)  # 96 heads zero-padded to head_dim
    assert "model.layers.0.self_attn.g_proj.weight" in shapes
    assert not any("g_a_proj" in n for n in shapes)


def test_published_config_round_trips_unchanged_with_vision_and_media_keys():
    d = published()
    assert K3Config.from_hf_dict(d).to_hf_dict() == d


def test_reads_kimi_linear_hub_config_with_hub_key_names():
    hub = {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "model_max_length": 1048576,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "moe_router_activation_func": "sigmoid",
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            "head_dim": 128,
            "num_heads": 32,
            "short_conv_kernel_size": 4,
        },
        "architectures": ["KimiLinearForCausalLM"],
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    c = K3Config.from_hf_dict(hub)
    assert c == K3Config.from_preset("kimi-linear-48b-a3b")
    assert c.hf_text_extras == {"torch_dtype": "bfloat16", "use_cache": True}  # inert keys survive a round trip
    assert c.to_hf_dict()["use_cache"] is True


def test_transformers_kimi_linear_config_reads():
    transformers = pytest.importorskip("transformers")
    hf = transformers.KimiLinearConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config={
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "head_dim": 8,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
        },
    )
    c = K3Config.from_hf_dict(hf.to_dict())
    assert c.layer_kinds == ("kda", "kda", "kda", "mla") and c.num_experts == 4 and c.kda_gate_form == "softplus"


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(layer_kinds=("kda", "gqa")), "layer_kinds"),
        (dict(kda_gate_form="tanh"), "kda_gate_form"),
        (dict(kda_gate_lower_bound=1.0, kda_gate_form="lower_bound"), "kda_gate_lower_bound"),
        (dict(num_experts_per_token=17), "num_experts_per_token"),
        (dict(num_expert_group=3), "num_expert_group"),
        (dict(first_dense_layers=99), "first_dense_layers"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(moe_latent_size=None), "moe_latent_norm"),
        (dict(pad_token_id=512), "pad_token_id"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(hidden_size="128"), "hidden_size"),
        (dict(rms_norm_eps=None), "rms_norm_eps"),
        (dict(experts_mxfp4=True, moe_intermediate_size=48), "experts_mxfp4"),
    ],
)
def test_invalid_combinations_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"K3Config.{field}"):
        K3Config.from_preset("k3-tiny", **change)


def _edit(d: dict, path: str, value) -> dict:
    d = json.loads(json.dumps(d))
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return d


DELETE = object()


@pytest.mark.parametrize(
    "path, value, named",
    [
        # keys that look like K3's but are not understood
        ("text_config.moe_latent_size", 3584, "text_config.moe_latent_size"),
        ("text_config.situ_beta", 4.0, "text_config.situ_beta"),
        ("text_config.linear_attn_config.gate_type", "lower_bound", "linear_attn_config.gate_type"),
        ("text_config.linear_attn_config.a_log_padded_len", 128, "linear_attn_config.a_log_padded_len"),
        ("text_config.mla_output_gate", True, "text_config.mla_output_gate"),
        ("text_config.rope_type", "yarn", "text_config.rope_type"),
        ("vision_tower_config", {}, "vision_tower_config"),
        # K3 key combinations we do not implement
        ("text_config.mla_use_nope", False, "text_config.mla_use_nope"),
        ("text_config.num_nextn_predict_layers", 1, "text_config.num_nextn_predict_layers"),
        ("text_config.moe_router_activation_func", "softmax", "text_config.moe_router_activation_func"),
        ("text_config.moe_layer_freq", 2, "text_config.moe_layer_freq"),
        ("text_config.topk_method", "group_limited_greedy", "text_config.topk_method"),
        ("text_config.hidden_act", "gelu", "text_config.hidden_act"),
        ("text_config.routed_expert_hidden_size", None, "text_config.latent_moe_use_norm"),
        ("text_config.quantization_config.config_groups.group_0.weights.num_bits", 8, "num_bits"),
        ("text_config.quantization_config.quant_method", "gptq", "quantization"),
        # values and structure
        ("text_config.num_experts_per_token", 1000, "text_config.num_experts_per_token"),
        ("text_config.hidden_size", "7168", "text_config.hidden_size"),
        ("text_config.linear_attn_config.head_dim", None, "text_config.linear_attn_config.head_dim"),
        ("text_config.linear_attn_config.gate_lower_bound", 5.0, "linear_attn_config.gate_lower_bound"),
        ("text_config.linear_attn_config.full_attn_layers", [4, 8], "neither kda_layers nor full_attn_layers"),
        ("text_config.linear_attn_config.kda_layers", [1, 1, 2], "assigned twice"),
        ("text_config.num_hidden_layers", 92, "full_attn_layers: layer 93 outside 1..92"),
        ("text_config.num_key_value_heads", 4, "text_config.num_key_value_heads"),
        ("text_config.model_type", "deepseek_v3", "text_config.model_type"),
        ("text_config", DELETE, "text_config"),
        ("eos_token_id", 7, "eos_token_id"),
        ("architectures", ["LlamaForCausalLM"], "architectures"),
        ("model_type", "llama", "model_type"),
        ("model_type", DELETE, "model_type"),
    ],
)
def test_bad_published_configs_name_the_key(path, value, named):
    with pytest.raises(ValueError, match=re.escape(named)) as e:
        K3Config.from_hf_dict(_edit(published(), path, value), "/ckpt/config.json")
    assert str(e.value).startswith("/ckpt/config.json ") and "\n" not in str(e.value)


def test_bad_config_files_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        K3Config.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        K3Config.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        K3Config.from_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="cannot read"):
        K3Config.from_json_file(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="unknown K3 preset"):
        K3Config.from_preset("k4")


def test_hybrid_layer_kinds():
    assert hybrid_layer_kinds(5) == ("kda", "kda", "kda", "mla", "mla")
    assert hybrid_layer_kinds(1) == ("mla",)
