"""K3Config: presets, parameter counts, HF config.json round trips, validation errors."""

import json

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
    from miles_k3.model.layout import layer_tensor_shapes
    import math
    got = sum(math.prod(s) for n, s in layer_tensor_shapes(c, 0).items() if n.startswith("self_attn."))
    assert got == kda


@pytest.mark.parametrize("name", PRESETS)
def test_hf_config_round_trip(tmp_path, name):
    c = K3Config.from_preset(name)
    c.to_json_file(tmp_path / "config.json")
    d = json.loads((tmp_path / "config.json").read_text())
    text = d["text_config"] if c.vl_wrapper else d
    assert text["model_type"] == "kimi_linear"
    assert ("quantization_config" in d) == c.experts_mxfp4
    assert K3Config.from_json_file(tmp_path / "config.json") == c


def test_reads_kimi_linear_hub_config_with_hub_key_names():
    hub = {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "num_expert_group": 1, "topk_group": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "model_max_length": 1048576, "bos_token_id": 163584,
        "eos_token_id": 163586, "pad_token_id": 163839, "moe_router_activation_func": "sigmoid",
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                               "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                               "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
        "architectures": ["KimiLinearForCausalLM"], "torch_dtype": "bfloat16", "use_cache": True,
    }
    c = K3Config.from_hf_dict(hub)
    preset = K3Config.from_preset("kimi-linear-48b-a3b")
    assert c.replace(extra_hf_keys={}) == preset
    assert c.extra_hf_keys == {"use_cache": True}  # unknown keys survive a round trip
    assert c.to_hf_dict()["use_cache"] is True


@pytest.mark.parametrize("change, field", [
    (dict(layer_kinds=("kda", "gqa")), "layer_kinds"),
    (dict(kda_gate_form="tanh"), "kda_gate_form"),
    (dict(kda_gate_lower_bound=1.0, kda_gate_form="lower_bound"), "kda_gate_lower_bound"),
    (dict(num_experts_per_token=17), "num_experts_per_token"),
    (dict(num_expert_group=3), "num_expert_group"),
    (dict(first_dense_layers=99), "first_dense_layers"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(moe_latent_size=None), "moe_latent_norm"),
    (dict(kda_a_log_padded_len=2), "kda_a_log_padded_len"),
    (dict(pad_token_id=512), "pad_token_id"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(experts_mxfp4=True, moe_intermediate_size=48), "experts_mxfp4"),
])
def test_invalid_combinations_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"K3Config.{field}"):
        K3Config.from_preset("k3-tiny", **change)


def test_bad_hf_configs_name_the_key(tmp_path):
    good = K3Config.from_preset("kimi-linear-48b-a3b").to_hf_dict()
    with pytest.raises(ValueError, match="quantization"):
        K3Config.from_hf_dict({**good, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    bad = json.loads(json.dumps(good))
    bad["linear_attn_config"]["full_attn_layers"] = [4, 8]
    with pytest.raises(ValueError, match="neither kda_layers nor full_attn_layers"):
        K3Config.from_hf_dict(bad)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        K3Config.from_hf_dict({**good, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="model_type"):
        K3Config.from_hf_dict({**good, "model_type": "llama"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K3Config.from_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="unknown K3 preset"):
        K3Config.from_preset("k4")


def test_hybrid_layer_kinds():
    assert hybrid_layer_kinds(5) == ("kda", "kda", "kda", "mla", "mla")
    assert hybrid_layer_kinds(1) == ("mla",)
