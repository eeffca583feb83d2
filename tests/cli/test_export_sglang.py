"""`miles-k3 export-adapter --format sglang`: the adapter file SGLang's LoRA loader applies to K3.

The expected names / shapes below are the rules read from sgl-project/sglang (python/sglang/srt/lora/):
- lora.py `LoRAAdapter._normalize_weights`: `_rename_expert_w_to_proj` renames `.w1.` / `.w3.` / `.w2.` to
  gate_proj / up_proj / down_proj; `normalize_gate_up_proj` concatenates gate and up (A and B along dim -2) and
  leaves an orphan up_proj unstacked; `normalize_fused_qkv_a_proj` keys on q_a_proj (kv_a alone is not fused).
- mem_pool.py `LoRAMemoryPool.load_lora_weight_to_buffer`: per-expert 2-D weights by `experts\\.(\\d+)\\.` go to
  `<target>_moe[expert_id]`; every weight is filed by layer index and `utils.get_target_module_name` (longest
  target that is a substring of the name), so the module prefix (block_sparse_moe / mlp, language_model.) does
  not matter; each expert must be present (the buffers are `torch.empty`).
- utils.py `get_normalized_target_modules`: target_modules must be a list (a string other than "all" /
  "all-linear" raises); the leaf name is normalized (gate_proj / up_proj -> gate_up_proj, q_a_proj ->
  fused_qkv_a_proj_with_mqa); `w1` / `w2` / `w3` are not mapped.
- lora_manager.py `LoRAManager.init_lora_modules`: a FusedMoE is wrapped only when both gate_up_proj and
  down_proj are targets; other modules by their leaf name (K3's fused_qkvg_proj is no target: KDA q/k/v/g are
  fused into it in models/kimi_k3.py `KimiK3LinearForCausalLM.load_weights`).
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch
from safetensors import safe_open

from miles_k3.model.config import K3Config
from miles_k3.model.layout import hf_prefix, tensor_shapes
from miles_k3.model.lora_spec import LoraSpec, adaptable_modules
from miles_k3.model.peft import (
    CONFIG_FILE,
    FAMILY_SGLANG,
    META_MODULES,
    WEIGHTS_FILE,
    load_peft,
    save_peft,
    sglang_tensors,
    sglang_unsupported,
)
from tests.cli.fixtures import spaced_arithmetic, write_checkpoint, write_prompts, write_resume_checkpoint

RANK = 4
_UNSUPPORTED = re.compile(
    r"\.self_attn\.(q_proj|k_proj|v_proj|g_proj|b_proj|f_a_proj|f_b_proj)$|\.routed_expert_(down|up)_proj$"
)
_LEAF = {
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
}
# utils.py _KNOWN_LORA_TARGET_MODULES (the normalized names SGLang's pool and modules handle) that K3 uses
_SGLANG_KNOWN = {"gate_up_proj", "down_proj", "o_proj", "q_b_proj", "kv_b_proj", "fused_qkv_a_proj_with_mqa", "lm_head"}


@pytest.fixture(scope="module")
def config():
    return K3Config.from_preset("k3-tiny")


def adapter(config, select=lambda m: True, seed=0):
    """Random engine-named adapter tensors for the adaptable modules `select` keeps."""
    g = torch.Generator().manual_seed(seed)
    shapes = tensor_shapes(config)
    out = {}
    for m in adaptable_modules(config):
        if not select(m):
            continue
        if ".experts.w" in m:
            prefix, proj = m.rsplit(".", 1)
            (o, i), lead = shapes[f"{prefix}.0.{proj}.weight"], (config.num_experts,)
        else:
            (o, i), lead = shapes[f"{m}.weight"], ()
        out[f"{m}.lora_A"] = torch.randn(*lead, RANK, i, generator=g)
        out[f"{m}.lora_B"] = torch.randn(*lead, o, RANK, generator=g)
    return out


def sglang_view(keys: list[str]) -> dict[tuple[int | None, str], set[int | None]]:
    """What SGLang's loader files the file's keys under: (layer, normalized target) -> expert ids (None: not
    an expert), after `_rename_expert_w_to_proj` and the leaf normalization."""
    view: dict = {}
    for k in keys:
        name = re.sub(r"\.w1\.", ".gate_proj.", re.sub(r"\.w3\.", ".up_proj.", re.sub(r"\.w2\.", ".down_proj.", k)))
        layer = re.search(r"layers\.(\d+)\.", name)
        leaf = re.search(r"\.([a-z_]+)\.lora_[AB]\.weight$", name)[1]
        expert = re.search(r"experts\.(\d+)\.", name)
        target = _LEAF.get(leaf, leaf) + ("_moe" if expert else "")
        view.setdefault((int(layer[1]) if layer else None, target), set()).add(int(expert[1]) if expert else None)
    return view


def test_export_names_shapes_and_config_are_what_sglang_loads(config, tmp_path):
    tensors = adapter(config, lambda m: not _UNSUPPORTED.search(m))
    out, partners, dropped = sglang_tensors(tensors, config)
    assert dropped == [] and partners == []  # every pair / triple is whole here
    save_peft(tmp_path / "a", out, LoraSpec(rank=RANK), family=FAMILY_SGLANG, zero_partners=partners)
    cfg = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    assert isinstance(cfg["target_modules"], list)
    assert {_LEAF.get(t, t) for t in cfg["target_modules"]} <= _SGLANG_KNOWN
    assert {"gate_proj", "up_proj", "down_proj"} <= set(cfg["target_modules"])  # FusedMoE gets wrapped
    assert cfg["r"] == RANK and cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}
    with safe_open(str(tmp_path / "a" / WEIGHTS_FILE), "pt") as f:
        keys = list(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    view = sglang_view(keys)
    moe_layers = {layer for (layer, t) in view if t.endswith("_moe")}
    assert moe_layers
    for layer in moe_layers:  # every expert of both MoE buffers, 2-D [r, in] / [out, r]
        for t in ("gate_up_proj_moe", "down_proj_moe"):
            assert view[(layer, t)] == set(range(config.num_experts))
    shp = tensor_shapes(config)
    for k, s in shapes.items():
        assert len(s) == 2, k
        e = re.search(r"^base_model\.model\.(.+\.experts)\.(\d+)\.(w[123])\.lora_([AB])\.weight$", k)
        if e:
            o, i = shp[f"{e[1]}.{e[2]}.{e[3]}.weight"]
            assert s == ((RANK, i) if e[4] == "A" else (o, RANK)), k
    assert not [k for k in keys if _UNSUPPORTED.search(k.rsplit(".lora_", 1)[0])]


def test_round_trip_reads_back_the_engine_tensors(config, tmp_path):
    # a w1-only expert adapter and a gate-only shared expert: SGLang needs the partners, written as zeros
    tensors = adapter(config, lambda m: not _UNSUPPORTED.search(m) and not re.search(r"w[23]$|up_proj$", m))
    out, partners, _ = sglang_tensors(tensors, config)
    assert partners and all(re.search(r"(w[23]|up_proj)$", p) for p in partners)
    assert all(not out[f"{p}.lora_A"].any() and not out[f"{p}.lora_B"].any() for p in partners)
    save_peft(tmp_path / "a", out, LoraSpec(rank=RANK, alpha=8.0), family=FAMILY_SGLANG, zero_partners=partners)
    with safe_open(str(tmp_path / "a" / WEIGHTS_FILE), "pt") as f:
        assert set(json.loads(f.metadata()[META_MODULES])) == {k.rsplit(".", 1)[0] for k in tensors}
    back, spec = load_peft(tmp_path / "a", config=config)
    assert back.keys() == tensors.keys() and spec.alpha == 8.0
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_unsupported_modules_fail_in_one_line_or_are_dropped(config):
    tensors = adapter(config)
    bad = sglang_unsupported({k.rsplit(".", 1)[0] for k in tensors})
    assert bad and all(_UNSUPPORTED.search(m) for m in bad)
    with pytest.raises(ValueError) as e:
        sglang_tensors(tensors, config)
    msg = str(e.value)
    assert "\n" not in msg and "--drop-unsupported" in msg
    assert "routed_expert_down_proj" in msg and "self_attn.f_a_proj" in msg
    out, _, dropped = sglang_tensors(tensors, config, drop_unsupported=True)
    assert set(dropped) == set(bad)
    assert not [k for k in out if _UNSUPPORTED.search(k.rsplit(".", 1)[0])]
    with pytest.raises(ValueError, match="SGLang cannot apply"):  # save_peft refuses them too
        save_peft("/nonexistent/never", tensors, LoraSpec(rank=RANK), family=FAMILY_SGLANG)


def _main(*argv):
    from miles_k3.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def test_cli_on_a_trainer_checkpoint(tmp_path):
    model = write_checkpoint(tmp_path / "base")
    config = K3Config.from_preset("k3-tiny")
    from miles_k3.data.prompts import PromptDataConfig, load_prompts

    records = load_prompts(PromptDataConfig(path=str(write_prompts(tmp_path / "p.jsonl", spaced_arithmetic(2)))))
    step = write_resume_checkpoint(tmp_path / "run", config, records, rank=RANK)
    argv = ["export-adapter", "--adapter", str(step / "adapter"), "--model", str(model), "--format", "sglang"]
    code, err = _main(*argv, "--out", str(tmp_path / "fail"))
    assert code != 0 and "SGLang cannot apply" in err and not (tmp_path / "fail").exists()
    assert len([line for line in err.splitlines() if "SGLang cannot apply" in line]) == 1
    code, err = _main(*argv, "--out", str(tmp_path / "s"), "--drop-unsupported")
    assert code == 0, err
    assert "dropped" in err and "routed_expert_down_proj" in err
    cfg = json.loads((tmp_path / "s" / CONFIG_FILE).read_text())
    assert isinstance(cfg["target_modules"], list) and "gate_proj" in cfg["target_modules"]
    back, _ = load_peft(tmp_path / "s", module_prefix=hf_prefix(config), config=config)  # K3's VL wrapper
    assert back and not [k for k in back if _UNSUPPORTED.search(k.rsplit(".", 1)[0])]
