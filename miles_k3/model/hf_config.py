"""K3Config <-> HF `config.json` (`model_type: kimi_linear`), both layouts.

Kimi-Linear's hub keys are read under every alias transformers uses (it writes
`num_experts` where the hub has `num_local_experts`, and so on). K3 adds keys
of our own (see `_K3_TEXT_KEYS` and the extra `linear_attn_config` entries);
a config without them is Kimi-Linear, so missing K3 keys take Kimi-Linear's
behaviour, not K3's. Unknown keys are kept in `extra_hf_keys` and written back.
"""

from __future__ import annotations

from typing import Any

from miles_k3.model.config import K3Config

MXFP4_FORMAT = "mxfp4-pack-quantized"
EXPERT_TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"

# (field, hub key, aliases transformers may write instead)
_TEXT_KEYS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vocab_size", "vocab_size", ()),
    ("hidden_size", "hidden_size", ()),
    ("rms_norm_eps", "rms_norm_eps", ()),
    ("tie_word_embeddings", "tie_word_embeddings", ()),
    ("max_position_embeddings", "model_max_length", ("max_position_embeddings",)),
    ("bos_token_id", "bos_token_id", ()),
    ("eos_token_id", "eos_token_id", ()),
    ("pad_token_id", "pad_token_id", ()),
    ("mla_num_heads", "num_attention_heads", ()),
    ("q_lora_rank", "q_lora_rank", ()),
    ("kv_lora_rank", "kv_lora_rank", ()),
    ("qk_nope_head_dim", "qk_nope_head_dim", ()),
    ("qk_rope_head_dim", "qk_rope_head_dim", ()),
    ("v_head_dim", "v_head_dim", ()),
    ("first_dense_layers", "first_k_dense_replace", ()),
    ("dense_intermediate_size", "intermediate_size", ()),
    ("num_experts", "num_experts", ("num_local_experts",)),
    ("num_experts_per_token", "num_experts_per_token", ("num_experts_per_tok",)),
    ("moe_intermediate_size", "moe_intermediate_size", ()),
    ("num_shared_experts", "num_shared_experts", ("n_shared_experts",)),
    ("moe_renormalize", "moe_renormalize", ("norm_topk_prob",)),
    ("routed_scaling_factor", "routed_scaling_factor", ()),
    ("num_expert_group", "num_expert_group", ("n_group",)),
    ("topk_group", "topk_group", ()),
    ("hidden_act", "hidden_act", ()),
)
# K3-only keys (our names); absent in Kimi-Linear configs.
_K3_TEXT_KEYS = (
    "mla_output_gate", "mla_latent_norm_eps", "attn_res_block_size", "attn_res_eps",
    "shared_expert_intermediate_size", "moe_latent_size", "moe_latent_norm", "router_correction_bias",
    "situ_beta", "situ_beta_lin",
)
# linear_attn_config entries: (field, key); the K3 additions come after the hub's own.
_LINEAR_KEYS = (
    ("kda_head_dim", "head_dim"), ("kda_num_heads", "num_heads"), ("kda_conv_kernel", "short_conv_kernel_size"),
    ("kda_gate_form", "gate_type"), ("kda_gate_lower_bound", "gate_lower_bound"),
    ("kda_a_log_padded_len", "a_log_padded_len"), ("kda_output_gate", "output_gate"),
    ("kda_gate_rank", "gate_rank"), ("kda_a_log_per_channel", "a_log_per_channel"),
)
# What transformers writes that we derive from other fields; dropped on read, not kept as extras.
_DERIVED = {
    "layer_types", "mlp_layer_types", "linear_attn_config", "num_hidden_layers", "model_type", "architectures",
    "quantization_config", "qk_head_dim", "head_dim", "num_key_value_heads", "linear_head_dim",
    "linear_num_heads", "linear_conv_kernel_dim", "transformers_version", "dtype", "torch_dtype",
    "moe_router_activation_func", "use_grouped_topk", "mla_use_nope",
}
_KIMI_LINEAR_DEFAULTS = {  # behaviour a flat config without K3 keys implies
    "kda_gate_form": "softplus", "kda_output_gate": "low_rank", "hidden_act": "silu",
}


def _first(d: dict[str, Any], keys: tuple[str, ...]) -> tuple[bool, Any]:
    for k in keys:
        if k in d:
            return True, d[k]
    return False, None


def _layer_kinds(text: dict[str, Any]) -> tuple[str, ...]:
    lac = text.get("linear_attn_config") or {}
    n = text.get("num_hidden_layers")
    if "kda_layers" in lac and "full_attn_layers" in lac:
        n = n or len(lac["kda_layers"]) + len(lac["full_attn_layers"])
        kinds: list[str | None] = [None] * n
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            for one_based in lac[key]:
                if not 1 <= one_based <= n:
                    raise ValueError(f"config linear_attn_config.{key}: layer {one_based} outside 1..{n}")
                kinds[one_based - 1] = kind
        missing = [i + 1 for i, k in enumerate(kinds) if k is None]
        if missing:
            raise ValueError(f"config linear_attn_config: layers {missing} are neither kda_layers nor full_attn_layers")
        return tuple(kinds)  # type: ignore[arg-type]
    if "layer_types" in text:
        table = {"linear_attention": "kda", "full_attention": "mla"}
        try:
            return tuple(table[t] for t in text["layer_types"])
        except KeyError as e:
            raise ValueError(f"config layer_types: unknown layer type {e.args[0]!r}") from None
    raise ValueError("config: needs linear_attn_config.{kda_layers,full_attn_layers} or layer_types")


def _check_quantization(q: dict[str, Any] | None) -> bool:
    if not q:
        return False
    method = q.get("quant_method")
    fmt = q.get("format")
    if method != "compressed-tensors" or fmt != MXFP4_FORMAT:
        raise ValueError(
            f"config quantization_config: unsupported quantization (quant_method={method!r}, format={fmt!r}); "
            f"only compressed-tensors {MXFP4_FORMAT!r} routed experts are supported")
    return True


def config_from_hf(d: dict[str, Any]) -> K3Config:
    """Parse an HF config dict (wrapper or flat). ValueError names the offending key."""
    if not isinstance(d, dict):
        raise ValueError("config: expected a JSON object")
    vl_wrapper = "text_config" in d
    text = d["text_config"] if vl_wrapper else d
    if text.get("model_type", "kimi_linear") != "kimi_linear":
        raise ValueError(f"config model_type: expected 'kimi_linear', got {text.get('model_type')!r}")
    kw: dict[str, Any] = dict(_KIMI_LINEAR_DEFAULTS)
    for fname, key, aliases in _TEXT_KEYS:
        found, val = _first(text, (key, *aliases))
        if found:
            kw[fname] = val
    for key in _K3_TEXT_KEYS:
        if key in text:
            kw[key] = text[key]
    for fname, key in _LINEAR_KEYS:
        lac = text.get("linear_attn_config") or {}
        if key in lac:
            kw[fname] = lac[key]
        elif fname in ("kda_head_dim", "kda_num_heads", "kda_conv_kernel"):
            alias = {"kda_head_dim": "linear_head_dim", "kda_num_heads": "linear_num_heads",
                     "kda_conv_kernel": "linear_conv_kernel_dim"}[fname]
            if alias in text:
                kw[fname] = text[alias]
    kw["layer_kinds"] = _layer_kinds(text)
    if "mlp_layer_types" in text and "first_k_dense_replace" not in text:
        types = list(text["mlp_layer_types"])
        n_dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if any(t != "sparse" for t in types[n_dense:]):
            raise ValueError("config mlp_layer_types: only a dense prefix followed by sparse layers is supported")
        kw["first_dense_layers"] = n_dense
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    heads = text.get("num_key_value_heads")
    if heads is not None and heads != kw.get("mla_num_heads", heads):
        raise ValueError("config num_key_value_heads: MLA expands one latent to all heads; it must equal "
                         f"num_attention_heads ({kw.get('mla_num_heads')}), got {heads}")
    qc = d.get("quantization_config") or text.get("quantization_config")
    kw["experts_mxfp4"] = _check_quantization(qc)
    kw["vl_wrapper"] = vl_wrapper
    kw["extra_hf_keys"] = {k: v for k, v in text.items()
                           if k not in _DERIVED and k not in _K3_TEXT_KEYS
                           and not any(k == key or k in al for _, key, al in _TEXT_KEYS)}
    try:
        return K3Config(**kw)
    except TypeError as e:
        raise ValueError(f"config: {e}") from e


def _quantization_config() -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "config_groups": {"group_0": {
            "targets": [EXPERT_TARGET], "format": MXFP4_FORMAT,
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                        "symmetric": True, "scale_dtype": "e8m0"},
        }},
        "ignore": ["lm_head"],
    }


def config_to_hf(c: K3Config) -> dict[str, Any]:
    text: dict[str, Any] = dict(c.extra_hf_keys)
    text.update({key: getattr(c, fname) for fname, key, _ in _TEXT_KEYS})
    text["model_type"] = "kimi_linear"
    text["num_hidden_layers"] = c.num_hidden_layers
    text["num_key_value_heads"] = c.mla_num_heads
    text["moe_router_activation_func"] = "sigmoid"
    lac = {key: getattr(c, fname) for fname, key in _LINEAR_KEYS}
    lac["kda_layers"] = [i + 1 for i, k in enumerate(c.layer_kinds) if k == "kda"]
    lac["full_attn_layers"] = [i + 1 for i, k in enumerate(c.layer_kinds) if k == "mla"]
    text["linear_attn_config"] = lac
    text.update({key: getattr(c, key) for key in _K3_TEXT_KEYS})
    if not c.vl_wrapper:
        text["architectures"] = ["KimiLinearForCausalLM"]
        if c.experts_mxfp4:
            text["quantization_config"] = _quantization_config()
        return text
    out: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    if c.experts_mxfp4:
        out["quantization_config"] = _quantization_config()
    return out
