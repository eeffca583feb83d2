"""VL checkpoints: text + vision saved together reload bit-identical (one file or shards), a missing or
misshapen vision tensor fails by name before any data is read, a text-only checkpoint still loads as text."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.checkpoint import INDEX_FILE
from miles_k3.model.vision import K3VisionModel

GRIDS = torch.tensor([[1, 8, 8], [2, 4, 6]])
PIXELS = torch.randn(64 + 48, 3, 14, 14, generator=torch.Generator().manual_seed(0))


def _pair(seed=0):
    config = K3Config.from_preset("k3-tiny-vl")
    torch.manual_seed(seed)
    return K3ForCausalLM(config).eval(), K3VisionModel(config.vision_config).eval()


def _assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture
def saved(tmp_path):
    text, vision = _pair()
    vision.save_pretrained(tmp_path / "vl", text)
    return tmp_path / "vl", text, vision


def test_vl_round_trip_is_bit_identical(saved):
    path, text, vision = saved
    stored = load_file(path / "model.safetensors")
    assert {k for k in stored if not k.startswith("language_model.")} == set(vision.config.tensor_shapes())
    text2, vision2 = K3ForCausalLM.from_pretrained(path), K3VisionModel.from_pretrained(path)
    _assert_same(text, text2)
    _assert_same(vision, vision2)
    with torch.no_grad():
        assert torch.equal(vision.encode(PIXELS, GRIDS), vision2.encode(PIXELS, GRIDS))
    config = json.loads((path / "config.json").read_text())
    assert config["vision_config"] == vision.config.to_hf_dict() and config["media_placeholder_token_id"] == 3


def test_sharded_vl_round_trip_lists_the_vision_tensors_in_the_index(tmp_path):
    text, vision = _pair(1)
    vision.save_pretrained(tmp_path / "vl", text, max_shard_bytes=200_000)
    weight_map = json.loads((tmp_path / "vl" / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2 and set(vision.config.tensor_shapes()) <= set(weight_map)
    _assert_same(vision, K3VisionModel.from_pretrained(tmp_path / "vl", dtype=torch.float64).float())
    _assert_same(text, K3ForCausalLM.from_pretrained(tmp_path / "vl"))


def test_from_pretrained_takes_dtype_and_device(saved):
    vision = K3VisionModel.from_pretrained(saved[0], dtype=torch.bfloat16, device="cpu")
    assert vision.dtype == torch.bfloat16 and vision.device.type == "cpu"
    assert vision.encode(PIXELS, GRIDS).dtype == torch.bfloat16


def test_a_missing_vision_tensor_is_named(saved):
    path = saved[0]
    tensors = load_file(path / "model.safetensors")
    del tensors["vision_tower.encoder.blocks.1.mlp.fc0.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 vision tensor\(s\) missing.*blocks.1.mlp.fc0.weight"):
        K3VisionModel.from_pretrained(path)
    K3ForCausalLM.from_pretrained(path)  # the text model does not read them


def test_a_misshapen_vision_tensor_is_named(saved):
    path = saved[0]
    tensors = load_file(path / "model.safetensors")
    tensors["mm_projector.proj.2.weight"] = torch.zeros(64, 256)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"'mm_projector.proj.2.weight': shape \(64, 256\) does not match "
        r"vision_config \(expected \(128, 256\)\)",
    ):
        K3VisionModel.from_pretrained(path)


def test_an_unexpected_vision_tensor_is_named(saved):
    path = saved[0]
    tensors = load_file(path / "model.safetensors")
    tensors["vision_tower.encoder.blocks.2.wo.weight"] = torch.zeros(64, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"not in the vision_config's layout.*blocks.2.wo.weight"):
        K3VisionModel.from_pretrained(path)


def test_a_text_only_checkpoint_loads_as_text_and_refuses_the_vision_model(tmp_path):
    text, _ = _pair()
    text.save_pretrained(tmp_path / "text")  # a VL config, text weights only
    _assert_same(text, K3ForCausalLM.from_pretrained(tmp_path / "text"))
    with pytest.raises(ValueError, match="no vision tensors.*a text-only checkpoint"):
        K3VisionModel.from_pretrained(tmp_path / "text")
    torch.manual_seed(0)
    K3ForCausalLM(K3Config.from_preset("k3-tiny")).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"config.json: no vision_config \(a text-only checkpoint\)"):
        K3VisionModel.from_pretrained(tmp_path / "plain")


def test_a_projector_that_does_not_write_the_text_width_is_named(saved):
    path = saved[0]
    d = json.loads((path / "config.json").read_text())
    d["vision_config"]["text_hidden_size"] = 96
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="vision_config.text_hidden_size: 96 differs from text_config.hidden_size 128"):
        K3VisionModel.from_pretrained(path)


def test_saving_a_tower_the_config_does_not_describe_is_refused(tmp_path):
    text, _ = _pair()
    other = K3VisionModel(text.config.vision_config.replace(vt_num_hidden_layers=1))
    with pytest.raises(ValueError, match="vision model's config differs from the text config's vision_config"):
        other.save_pretrained(tmp_path / "vl", text)
    assert not (tmp_path / "vl").exists()
