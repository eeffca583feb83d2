"""LoRA targets checked against the model before it is built: `adaptable_modules` reads off the tensor
layout exactly the modules the trainer's policy adapts, and `LoraSpec.check_matches` rejects targets that
select nothing."""

import pytest

from megatron_patches.lora import lora_modules
from megatron_patches.model import build_policy
from megatron_patches.parallel import ensure_parallel
from miles_k3.model import K3Config
from miles_k3.model.lora_spec import LoraSpec, adaptable_modules

# k3-tiny has every K3 feature; the Kimi-Linear form has none of them (q_proj instead of q_a/q_b, no latent
# MoE, no AttnRes, low-rank KDA output gate, no MLA output gate)
KIMI_LINEAR_FORM = dict(
    q_lora_rank=None,
    moe_latent_size=None,
    moe_latent_norm=False,
    attn_res_block_size=0,
    kda_output_gate="low_rank",
    mla_output_gate=False,
    num_shared_experts=1,
)


@pytest.mark.parametrize("overrides", [{}, KIMI_LINEAR_FORM], ids=["k3", "kimi-linear"])
def test_adaptable_modules_are_what_a_catch_all_spec_adapts(overrides):
    config = K3Config.from_preset("k3-tiny", **overrides)
    ensure_parallel()
    policy = build_policy(config, None, LoraSpec(rank=2, targets=(".",)))
    assert sorted(m.name for m in lora_modules(policy)) == sorted(adaptable_modules(config))


def test_check_matches():
    modules = adaptable_modules(K3Config.from_preset("k3-tiny"))
    LoraSpec().check_matches(modules)  # the default set: some of its patterns match nothing here, by design
    LoraSpec(targets=(r"q_proj$", r"experts\.w1$")).check_matches(modules)
    with pytest.raises(ValueError, match=r"^LoraSpec.targets match no module of this model"):
        LoraSpec(targets=("nothing",)).check_matches(modules)
    with pytest.raises(ValueError, match=r"^LoraSpec.targets: 'qq_proj\$' matches no module"):
        LoraSpec(targets=(r"q_proj$", r"qq_proj$")).check_matches(modules)
