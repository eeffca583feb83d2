"""Adapters both ways between miles-k3 and real PEFT on transformers' own KimiLinearForCausalLM (fp32, CPU), on
a random tiny Kimi-Linear checkpoint saved by transformers with MoE layers:

(a) the trainer's adapter (`adapter_state` -> `save_peft`, random non-zero B on every module, experts included)
    loads through `PeftModel.from_pretrained` with every tensor applied (and through transformers'
    `load_adapter`), and gives the trainer's log-probs;
(b) an adapter PEFT itself made on that model (every linear, stacked experts through `target_parameters`, a
    rank_pattern / alpha_pattern module) loads through `load_peft` and gives PEFT's log-probs through our
    engine (`build_engine` with `adapters=`);
(c) `miles-k3 export-adapter --format merged` equals the adapter applied (transformers loads it), and
    `--format peft` writes the family's naming;
(d) a tensor we cannot place fails with one line naming its module and the file (and the --adapter flag).
"""

from __future__ import annotations

import json
import math

import peft
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_patches.lora import adapter_state, load_adapter_state
from megatron_patches.model import build_policy
from miles_k3.model import K3ForCausalLM
from miles_k3.model.lora_spec import DEFAULT_TARGETS, FAMILY_KIMI_LINEAR, LoraSpec, adapter_family
from miles_k3.model.peft import CONFIG_FILE, WEIGHTS_FILE, load_peft, save_peft
from tests.megatron_patches.common import random_like
from tests.model.kimi_linear_oracle import random_kimi_linear

TOL = 1e-4
# every kind of module the Kimi-Linear form adapts: attention, forget gate, dense MLP, shared and routed experts
TARGETS = (*DEFAULT_TARGETS, r"self_attn\.f_[ab]_proj$", r"^lm_head$")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    random_kimi_linear(path, layers=4, experts=4, top_k=2, seed=7)
    ours = K3ForCausalLM.from_pretrained(path).eval()
    assert adapter_family(ours.config) == FAMILY_KIMI_LINEAR
    return path, ours


def hf_model(path):
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM.from_pretrained(path).float().eval()


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(3))


def logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token [B, T-1]."""
    return logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]


def all_applied(model: peft.PeftModel, adapter_dir) -> None:
    """Every tensor of the adapter file is one of the PEFT model's LoRA weights, with its value, and the model
    has no LoRA weight the file does not set: nothing was dropped on either side."""
    loaded = {k: v for k, v in peft.get_peft_model_state_dict(model).items() if ".lora_" in k}
    written = load_file(str(adapter_dir / WEIGHTS_FILE))
    assert set(loaded) == set(written), sorted(set(loaded) ^ set(written))[:6]
    assert all(torch.equal(loaded[k], written[k]) for k in written)


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    """(adapter dir, our tensors, spec, the trainer build's log-probs) of a random trainer adapter."""
    path, ours = base
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.05, targets=TARGETS)
    policy = build_policy(ours.config, ours.state_dict(), spec, dtype=torch.float32)
    tensors = random_like(adapter_state(policy), seed=1)
    load_adapter_state(policy, tensors)
    out = tmp_path_factory.mktemp("adapter") / "a"
    save_peft(out, tensors, spec)  # the trainer's call: the family is inferred from the modules
    tokens = ids(ours.config.vocab_size)
    with torch.no_grad():
        want = logprobs(policy.eval()(tokens).logits, tokens)
    return out, tensors, spec, want


def test_a_trainer_adapter_loads_whole_in_peft_and_gives_the_trainers_logprobs(base, trained):
    path, _ = base
    adapter, tensors, spec, want = trained
    cfg = json.loads((adapter / CONFIG_FILE).read_text())
    assert cfg["target_parameters"] and cfg["lora_dropout"] == 0.0  # ParamWrapper refuses dropout
    keys = load_file(str(adapter / WEIGHTS_FILE)).keys()
    assert "base_model.model.model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.self_attn.forget_gate.f_a_proj.lora_B.weight" in keys
    assert not [k for k in keys if "block_sparse_moe" in k]
    model = peft.PeftModel.from_pretrained(hf_model(path), str(adapter)).eval()
    all_applied(model, adapter)
    tokens = ids(64)
    with torch.no_grad():
        got = logprobs(model(tokens).logits, tokens)
    assert (got - want).abs().max() <= TOL
    hf = hf_model(path)  # transformers' own PEFT integration reads it the same way
    hf.load_adapter(str(adapter))
    with torch.no_grad():
        assert (logprobs(hf(tokens).logits, tokens) - want).abs().max() <= TOL
    # and back: bit-exact, dropout included (it travels in the metadata)
    back, spec2 = load_peft(adapter)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert (spec2.rank, spec2.alpha, spec2.dropout) == (spec.rank, spec.alpha, spec.dropout)


def _peft_made(path, out):
    """An adapter PEFT builds on transformers' model: every linear (lm_head included: PEFT then also saves
    lm_head's base weight), the stacked experts through target_parameters, o_proj at rank 2 with its own
    alpha; random A and non-zero B everywhere."""
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=r".*(_proj|lm_head)$",
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        rank_pattern={r"self_attn\.o_proj": 2},
        alpha_pattern={r"self_attn\.o_proj": 3},
    )
    model = peft.get_peft_model(hf_model(path), cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(str(out))
    return model.eval()


def test_b_a_peft_adapter_gives_peft_logprobs_through_our_engine(base, tmp_path):
    from rollout.build import EngineSpec, build_engine
    from rollout.config import EngineConfig
    from rollout.request import SamplingParams

    path, ours = base
    model = _peft_made(path, tmp_path / "p")
    tensors, spec = load_peft(tmp_path / "p", config=ours.config)
    assert any(".experts.w1" in k for k in tensors) and any(".shared_experts." in k for k in tensors)
    assert any(".self_attn.f_a_proj" in k for k in tensors)
    engine = build_engine(
        EngineSpec(
            path=str(path),
            quantize="none",
            adapters=(("peft", str(tmp_path / "p")),),
            engine=EngineConfig(memory_bytes=8 << 20, max_seq_len=64),
        )
    )
    prompts = [[5, 9, 17, 33, 2 + 1], [40, 41, 7]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5), adapter="peft")
    for prompt, c in zip(prompts, out):
        seq = torch.tensor([prompt + c.output_ids])
        with torch.no_grad():
            want = logprobs(model(seq).logits, seq)[0, len(prompt) - 1 :]
        assert (torch.tensor(c.logprobs) - want).abs().max() <= TOL, (c.logprobs, want)


def test_c_export_merged_equals_the_adapter_applied_and_peft_keeps_the_family(base, trained, tmp_path):
    from miles_k3.cli.main import main

    path, _ = base
    adapter, tensors, spec, want = trained
    assert main(["export-adapter", "--adapter", str(adapter), "--model", str(path), "--out", str(tmp_path / "m"),
                 "--format", "merged"]) == 0  # fmt: skip
    merged = hf_model(tmp_path / "m")
    tokens = ids(64)
    with torch.no_grad():
        got = logprobs(merged(tokens).logits, tokens)
    assert (got - want).abs().max() <= TOL
    assert main(["export-adapter", "--adapter", str(adapter), "--model", str(path), "--out", str(tmp_path / "p")]) == 0
    back, _ = load_peft(tmp_path / "p")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    with safe_open(str(tmp_path / "p" / WEIGHTS_FILE), "pt") as f:
        assert not [k for k in f.keys() if "block_sparse_moe" in k]


def _with_extra(adapter, out, key_a: str | None, config_edit=None):
    """A copy of `adapter` with an extra module `key_a` (rank 4 into 32, out 16) and `config_edit` applied."""
    out.mkdir()
    w = load_file(str(adapter / WEIGHTS_FILE))
    if key_a is not None:
        w[key_a] = torch.zeros(4, 32)
        w[key_a.replace("lora_A", "lora_B")] = torch.zeros(16, 4)
    save_file(w, str(out / WEIGHTS_FILE))  # no metadata: read as a foreign file
    cfg = json.loads((adapter / CONFIG_FILE).read_text())
    if config_edit:
        config_edit(cfg)
    (out / CONFIG_FILE).write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "key, config_edit, needle",
    [
        ("base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight", None, "model.layers.0.self_attn.foo_proj"),
        ("base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight", None, "model.layers.9.self_attn.q_proj"),
        (None, lambda c: c.pop("target_parameters"), "model.layers.1.mlp.experts"),
    ],
)
def test_d_a_module_we_cannot_place_fails_naming_it(base, trained, tmp_path, capsys, key, config_edit, needle):
    from miles_k3.cli.main import main

    path, ours = base
    adapter = trained[0]
    bad = _with_extra(adapter, tmp_path / "bad", key, config_edit)
    with pytest.raises(ValueError) as e:
        load_peft(bad, config=ours.config)
    msg = str(e.value)
    assert needle in msg and str(bad / WEIGHTS_FILE) in msg and "\n" not in msg
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 9, 17]}\n')
    args = ["generate", "--model", str(path), "--input-ids", str(tmp_path / "p.jsonl"), "--adapter", str(bad)]
    status = main([*args, "--quantize", "none", "--max-new-tokens", "2"])  # the command line names the flag
    err = capsys.readouterr().err
    assert status == 2 and "--adapter" in err and needle in err and err.count("\n") == 1, err


def test_stacked_and_shared_outer_expert_layouts_read(base, trained, tmp_path):
    """Miles' shared-outer K3 export: one 3-D tensor per expert projection, a leading 1 shared by the experts."""
    _, ours = base
    tensors = trained[1]
    w = {}
    for k, t in tensors.items():
        module, ab = k.rsplit(".", 1)
        if t.dim() == 3 and module.endswith(("w1", "w3")) and ab == "lora_A":
            t = t[:1]  # w1 / w3 share A across experts
        w[f"base_model.model.{module}.{ab}.weight"] = t
    (tmp_path / "s").mkdir()
    save_file(w, str(tmp_path / "s" / WEIGHTS_FILE))
    (tmp_path / "s" / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8.0}))
    back, _ = load_peft(tmp_path / "s", config=ours.config)
    for k, t in tensors.items():
        want = t[:1].expand_as(t) if t.dim() == 3 and k.endswith(("w1.lora_A", "w3.lora_A")) else t
        assert torch.equal(back[k], want), k
    assert math.isclose(trained[2].alpha, 8.0)


def test_export_keeps_k3_naming_for_a_k3_checkpoint(tmp_path):
    """A K3-form base (LatentMoE, MXFP4 experts): --format peft writes K3's published names (one module per
    expert, block_sparse_moe), --format merged a dense checkpoint holding base + alpha / r * B A."""
    from miles_k3.cli.main import main
    from miles_k3.model.assets import builtin_path
    from miles_k3.model.base import load_base
    from tests.megatron_patches.common import merged_state
    from tests.server.common import MODEL, write_adapter

    adapter = write_adapter(tmp_path / "a", seed=2)
    assert main(["export-adapter", "--adapter", str(adapter), "--model", MODEL, "--out", str(tmp_path / "p")]) == 0
    keys = load_file(str(tmp_path / "p" / WEIGHTS_FILE)).keys()
    assert any(".block_sparse_moe.experts.0.w1.lora_A.weight" in k for k in keys)
    assert not [k for k in keys if ".mlp.experts" in k or "forget_gate" in k]
    argv = ["export-adapter", "--adapter", str(adapter), "--model", MODEL, "--out", str(tmp_path / "m")]
    assert main([*argv, "--format", "merged"]) == 0
    _, base = load_base(builtin_path(MODEL))
    tensors, spec = load_peft(adapter)
    want = merged_state(base, tensors, spec.alpha / spec.rank)
    got = K3ForCausalLM.from_pretrained(tmp_path / "m").state_dict()
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
