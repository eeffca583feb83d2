"""The HF tensor layout of a K3-family checkpoint, derived from a K3Config.

One source of truth for tensor names and logical shapes: parameter counting,
checkpoint validation and saving all read it, and the reference model's
`state_dict()` keys equal it (a test holds them together). Names carry no
wrapper prefix; `hf_prefix(config)` gives it (K3's `language_model.`).
"""

from __future__ import annotations

import re

from miles_k3.model.config import K3Config

_ROUTED_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def hf_prefix(config: K3Config) -> str:
    return "language_model." if config.vl_wrapper else ""


def is_routed_expert_tensor(name: str) -> bool:
    return _ROUTED_EXPERT.search(name) is not None


def kda_a_log_shape(config: K3Config) -> tuple[int, ...]:
    """How a checkpoint stores the per-head decay A_log: K3 (lower-bound gate) as a flat fp32 vector of
    head_dim entries, the heads first and zero-padded (no config key says so; 96 heads in 128 entries);
    Kimi-Linear as [1, 1, H, 1]. Loading accepts either layout for any config (`a_log_heads`)."""
    if config.kda_gate_form == "lower_bound":
        return (max(config.kda_head_dim, config.kda_num_heads),)
    return (1, 1, config.kda_num_heads, 1)


def a_log_heads(t, num_heads: int):
    """The H per-head values of an A_log stored in either layout ([1, 1, H, 1], or flat with the heads
    first and any padding after them), or None if `t` is neither."""
    flat_ok = t.dim() == 1 and t.shape[0] >= num_heads
    kimi_ok = tuple(t.shape) == (1, 1, num_heads, 1)
    return t.reshape(-1)[:num_heads] if flat_ok or kimi_ok else None


def _kda_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    d, hk, r = c.hidden_size, c.kda_dim, c.gate_rank
    shapes = {f"{p}_proj.weight": (hk, d) for p in "qkv"}
    shapes.update({f"{p}_conv1d.weight": (hk, 1, c.kda_conv_kernel) for p in "qkv"})
    shapes.update(
        {
            "f_a_proj.weight": (r, d),
            "f_b_proj.weight": (hk, r),
            "A_log": kda_a_log_shape(c),
            "dt_bias": (hk,),
            "b_proj.weight": (c.kda_num_heads, d),
        }
    )
    if c.kda_output_gate == "full":
        shapes["g_proj.weight"] = (hk, d)
    else:
        shapes.update({"g_a_proj.weight": (r, d), "g_b_proj.weight": (hk, r)})
    shapes.update({"o_norm.weight": (c.kda_head_dim,), "o_proj.weight": (d, hk)})
    return shapes


def _mla_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    d, h = c.hidden_size, c.mla_num_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is None:
        shapes["q_proj.weight"] = (h * c.qk_head_dim, d)
    else:
        shapes.update(
            {
                "q_a_proj.weight": (c.q_lora_rank, d),
                "q_a_layernorm.weight": (c.q_lora_rank,),
                "q_b_proj.weight": (h * c.qk_head_dim, c.q_lora_rank),
            }
        )
    shapes.update(
        {
            "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, d),
            "kv_a_layernorm.weight": (c.kv_lora_rank,),
            "kv_b_proj.weight": (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            "o_proj.weight": (d, h * c.v_head_dim),
        }
    )
    if c.mla_output_gate:
        shapes["g_proj.weight"] = (h * c.v_head_dim, d)
    return shapes


def _glu_shapes(d: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {"gate_proj.weight": (inter, d), "up_proj.weight": (inter, d), "down_proj.weight": (d, inter)}


def _moe_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    d, w, i = c.hidden_size, c.expert_width, c.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"gate.weight": (c.num_experts, d)}
    if c.router_correction_bias:
        shapes["gate.e_score_correction_bias"] = (c.num_experts,)
    for e in range(c.num_experts):
        shapes.update(
            {f"experts.{e}.w1.weight": (i, w), f"experts.{e}.w2.weight": (w, i), f"experts.{e}.w3.weight": (i, w)}
        )
    if c.num_shared_experts > 0:
        shapes.update({f"shared_experts.{k}": s for k, s in _glu_shapes(d, c.shared_intermediate).items()})
    if c.moe_latent_size is not None:
        shapes["routed_expert_down_proj.weight"] = (w, d)
        if c.moe_latent_norm:
            shapes["routed_expert_norm.weight"] = (w,)
        shapes["routed_expert_up_proj.weight"] = (d, w)
    return shapes


def _res_shapes(c: K3Config, site: str) -> dict[str, tuple[int, ...]]:
    return {f"{site}_norm.weight": (c.hidden_size,), f"{site}_proj.weight": (1, c.hidden_size)}


def layer_tensor_shapes(c: K3Config, i: int) -> dict[str, tuple[int, ...]]:
    """Shapes of layer i's tensors, names relative to `model.layers.{i}.`."""
    d = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if c.attn_res_block_size:
        shapes.update(_res_shapes(c, "self_attention_res"))
    shapes["input_layernorm.weight"] = (d,)
    mixer = _kda_shapes(c) if c.layer_kinds[i] == "kda" else _mla_shapes(c)
    shapes.update({f"self_attn.{k}": s for k, s in mixer.items()})
    if c.attn_res_block_size:
        shapes.update(_res_shapes(c, "mlp_res"))
    shapes["post_attention_layernorm.weight"] = (d,)
    if c.is_moe_layer(i):
        shapes.update({f"block_sparse_moe.{k}": s for k, s in _moe_shapes(c).items()})
    else:
        shapes.update({f"mlp.{k}": s for k, s in _glu_shapes(d, c.dense_intermediate_size).items()})
    return shapes


def tensor_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the logical (dense) checkpoint, HF names without wrapper prefix -> shape."""
    v, d = c.vocab_size, c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer_tensor_shapes(c, i).items()})
    shapes["model.norm.weight"] = (d,)
    if c.attn_res_block_size:
        shapes.update({f"model.{k}": s for k, s in _res_shapes(c, "output_attn_res").items()})
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes
