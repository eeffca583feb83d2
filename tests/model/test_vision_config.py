"""VisionConfig: the published K3 vision_config parses and round-trips, bad fields fail by name, the typed
config is what K3Config hands out, and the k3-tiny-vl preset fits its text model."""

import json
from pathlib import Path

import pytest

from miles_k3.model import K3Config
from miles_k3.model.vision_config import VisionConfig

FIXTURE = Path(__file__).parent / "fixtures" / "kimi_k3_config.json"  # the published K3 config.json's values


def _published() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_published_vision_config_parses_to_the_released_tower():
    vc = VisionConfig.from_hf_dict(_published()["vision_config"])
    assert vc == VisionConfig()  # the defaults are the released values
    assert (vc.vt_hidden_size, vc.vt_num_hidden_layers, vc.head_dim, vc.projector_width) == (1024, 27, 128, 4096)
    assert vc.merge_kernel_size == (2, 2) and vc.text_hidden_size == 7168
    assert vc.extras == {"_attn_implementation": "flash_attention_2"}


def test_round_trip_to_dict_is_exact_and_carries_unknown_keys():
    d = _published()["vision_config"]
    assert VisionConfig.from_hf_dict(d).to_hf_dict() == d
    d.update(model_type="kimi_k3_vision", some_later_key={"a": [1, 2]})
    back = VisionConfig.from_hf_dict(d).to_hf_dict()
    assert back == d and back["some_later_key"] == {"a": [1, 2]}


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("patch_size", 0, "vision_config.patch_size: must be a positive int"),
        ("vt_hidden_size", "1024", "vision_config.vt_hidden_size: must be int"),
        ("qkv_hidden_size", 1000, "vision_config.qkv_hidden_size: must divide into vt_num_attention_heads=12"),
        ("qkv_hidden_size", 12 * 6, r"vision_config.qkv_hidden_size: the 2-D rotary embedding needs head_dim % 4"),
        ("mm_hidden_size", 512, "vision_config.mm_hidden_size: .* must equal vt_hidden_size=1024"),
        ("merge_kernel_size", [2], r"vision_config.merge_kernel_size: must be two positive ints \[kh, kw\]"),
        ("merge_kernel_size", [2, 0], "vision_config.merge_kernel_size: must be two positive ints"),
        ("activation_func", "relu", "vision_config.activation_func: must be one of"),
        ("pos_emb_interpolation_mode", "nearest", "vision_config.pos_emb_interpolation_mode: must be one of"),
        ("norm_type", "layernorm", "vision_config.norm_type: only 'rmsnorm' is implemented"),
        ("attn_bias", True, "vision_config.attn_bias: only False is implemented"),
        ("mm_projector_type", "patchmerger", "vision_config.mm_projector_type: only 'patchmergerv2'"),
        ("projector_ln_eps", 0.0, "vision_config.projector_ln_eps: must be > 0"),
    ],
)
def test_a_bad_field_fails_by_name(key, value, match):
    d = _published()["vision_config"]
    d[key] = value
    with pytest.raises(ValueError, match=match):
        VisionConfig.from_hf_dict(d)


def test_a_bad_vision_key_in_config_json_fails_on_load_naming_file_and_key(tmp_path):
    d = _published()
    d["vision_config"]["vt_num_attention_heads"] = 0
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"config.json vision_config.vt_num_attention_heads: must be a positive int"):
        K3Config.from_json_file(tmp_path / "config.json")
    d["vision_config"] = [1, 2]
    with pytest.raises(ValueError, match="config.json vision_config: must be an object"):
        K3Config.from_hf_dict(d)


def test_a_media_pad_id_outside_the_vocabulary_fails_by_name():
    d = _published()
    d["media_placeholder_token_id"] = 163840
    with pytest.raises(ValueError, match=r"config.json media_placeholder_token_id: must be an int in \[0, vocab_size"):
        K3Config.from_hf_dict(d)


def test_k3config_hands_out_the_typed_vision_config():
    assert K3Config.from_preset("k3").vision_config == VisionConfig()
    assert K3Config.from_preset("k3").media_placeholder_token_id == 163605
    assert K3Config.from_preset("k3-tiny").vision_config is None
    assert K3Config.from_preset("kimi-linear-48b-a3b").media_placeholder_token_id is None


def test_k3_tiny_vl_is_k3_tiny_with_a_tiny_tower_that_fits_it():
    vl, text = K3Config.from_preset("k3-tiny-vl"), K3Config.from_preset("k3-tiny")
    assert vl == text  # the same text model (the wrapper extras are not compared)
    vc = vl.vision_config
    assert vc.text_hidden_size == vl.hidden_size == 128 and vl.media_placeholder_token_id == 3
    assert (vc.patch_size, vc.vt_hidden_size, vc.vt_num_hidden_layers, vc.vt_num_attention_heads) == (14, 64, 2, 4)
    assert vc.num_parameters() < 300_000
    back = K3Config.from_hf_dict(json.loads(json.dumps(vl.to_hf_dict())))
    assert back.vision_config == vc and back.media_placeholder_token_id == 3
