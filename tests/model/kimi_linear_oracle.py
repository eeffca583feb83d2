"""transformers' KimiLinearForCausalLM as an independent oracle: tiny random instances on disk."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from miles_k3.compat.transformers_kimi import use_torch_fallbacks


def random_kimi_linear(
    path: Path,
    *,
    hidden=32,
    layers=4,
    heads=2,
    head_dim=8,
    kda_heads=2,
    kda_head_dim=8,
    experts=4,
    top_k=2,
    n_group=1,
    topk_group=1,
    q_lora_rank=None,
    seed=0,
    vocab=64,
    tie=False,
    shared=1,
    torch_fallbacks=True,
):
    """Build a KimiLinear with every parameter randomized, save it HF-style to `path`, return the model."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    if torch_fallbacks:
        use_torch_fallbacks()
    kda_layers = [i + 1 for i in range(layers) if (i + 1) % 4 and i != layers - 1]
    full_layers = [i + 1 for i in range(layers) if i + 1 not in kda_layers]
    cfg = KimiLinearConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        kv_lora_rank=12,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=4,
        v_head_dim=head_dim,
        qk_nope_head_dim=head_dim,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=shared,
        linear_head_dim=kda_head_dim,
        linear_num_heads=kda_heads,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tie,
        routed_scaling_factor=2.446,
        linear_attn_config={
            "kda_layers": kda_layers,
            "full_attn_layers": full_layers,
            "head_dim": kda_head_dim,
            "num_heads": kda_heads,
            "short_conv_kernel_size": 4,
        },
    )
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 8.0).log())
            elif name.endswith("dt_bias"):
                p.uniform_(-3.0, 1.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    return model
