"""K3Config <-> HF `config.json`, in the schemas the published checkpoints use.

Kimi K3: `model_type: kimi_k3`, `architectures: [KimiK3ForConditionalGeneration]`; the language model
is `text_config` (itself `model_type: kimi_linear`) beside `vision_config` and the media keys, and its
weights carry `language_model.`. Kimi-Linear: the same text schema, flat. K3's features are switched on
by K3's own text keys, and a config without them is Kimi-Linear:

    linear_attn_config.gate_lower_bound   K3 KDA gate lower_bound * sigmoid(exp(A_log) f) (else softplus)
    linear_attn_config.use_full_rank_gate KDA output gate g_proj (else g_b_proj(g_a_proj(x)))
    mla_use_output_gate                   MLA output gate attn * sigmoid(g_proj(x))
    attn_res_block_size                   Attention Residuals with blocks of that many layers
    routed_expert_hidden_size             LatentMoE width; latent_moe_use_norm: its RMSNorm
    hidden_act: situ                      SiTU-GLU with activation_situ_beta / activation_situ_linear_beta

Every key read is either understood (mapped onto a K3Config field, or checked against the one value we
implement, e.g. `mla_use_nope: true`, `num_nextn_predict_layers: 0`), or inert (HF's generic keys such
as `use_cache`, and the wrapper's vision and media keys), which is carried through to the written
config unchanged. Anything else is a ValueError naming the key: nothing is dropped silently. The inert
`vision_config` is still checked on read (`K3Config.validate` parses it into a `VisionConfig`: a bad
vision key fails by name), and read typed through `K3Config.vision_config`.
"""

from __future__ import annotations

import json
from typing import Any

from miles_k3.model.config import ACTIVATIONS, K3Config

K3_MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"
TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
MXFP4_FORMAT = "mxfp4-pack-quantized"

# (field, key written, other spellings read: the hub's and transformers')
_TEXT_KEYS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vocab_size", "vocab_size", ()),
    ("hidden_size", "hidden_size", ()),
    ("rms_norm_eps", "rms_norm_eps", ()),
    ("tie_word_embeddings", "tie_word_embeddings", ()),
    ("max_position_embeddings", "max_position_embeddings", ("model_max_length",)),
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
    ("num_experts", "num_experts", ("num_local_experts", "n_routed_experts")),
    ("num_experts_per_token", "num_experts_per_token", ("num_experts_per_tok",)),
    ("moe_intermediate_size", "moe_intermediate_size", ()),
    ("num_shared_experts", "num_shared_experts", ("n_shared_experts",)),
    ("moe_renormalize", "moe_renormalize", ("norm_topk_prob",)),
    ("routed_scaling_factor", "routed_scaling_factor", ()),
    ("num_expert_group", "num_expert_group", ("n_group",)),
    ("topk_group", "topk_group", ()),
    ("hidden_act", "hidden_act", ()),
)
# K3 feature keys: (field, key); written only when the feature is on
_FEATURE_KEYS = (
    ("mla_output_gate", "mla_use_output_gate"),
    ("attn_res_block_size", "attn_res_block_size"),
    ("moe_latent_size", "routed_expert_hidden_size"),
    ("moe_latent_norm", "latent_moe_use_norm"),
    ("situ_beta", "activation_situ_beta"),
    ("situ_beta_lin", "activation_situ_linear_beta"),
)
_LINEAR_KEYS = (
    ("kda_head_dim", "head_dim"),
    ("kda_num_heads", "num_heads"),
    ("kda_conv_kernel", "short_conv_kernel_size"),
)
_LINEAR_ALIASES = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}  # transformers' flat spellings
_LINEAR_OWN = {"kda_layers", "full_attn_layers", "use_full_rank_gate", "gate_lower_bound", *_LINEAR_ALIASES}
# key: the one value implemented (a config that says otherwise asks for a model we do not build)
_FIXED = {
    "mla_use_nope": True,  # MLA without rotary embedding
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,  # every layer after the dense prefix is MoE
    "num_nextn_predict_layers": 0,  # no multi-token-prediction layers
}
_FIXED_UNWRITTEN = {"attention_bias": False, "mlp_bias": False}  # transformers' spellings; K3 writes neither
_TOPK_METHODS = {"noaux_tc": True, "greedy": False}  # -> router_correction_bias
# Written by transformers or derived from other keys; checked where they can disagree, else ignored.
_DERIVED = {
    "num_hidden_layers",
    "num_key_value_heads",
    "layer_types",
    "mlp_layer_types",
    "qk_head_dim",
    "head_dim",
    "linear_attn_config",
    "quantization_config",
    "model_type",
    "architectures",
    "use_grouped_topk",
    "topk_method",
    *_LINEAR_ALIASES.values(),
}
# HF's generic PretrainedConfig keys (transformers 4.x and 5.x) and training-only knobs: no effect on the
# text model, carried through unchanged.
_INERT = {
    "_name_or_path",
    "auto_map",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pretraining_tp",
    "output_router_logits",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "pruned_heads",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "cross_attention_hidden_size",
    "add_cross_attention",
    "tie_encoder_decoder",
    "finetuning_task",
    "id2label",
    "label2id",
    "problem_type",
    "task_specific_params",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
}
# The wrapper's keys beside text_config that the text model carries through (the vision path reads them).
_WRAPPER_INERT = {
    "vision_config",
    "media_placeholder_token_id",
    "image_placeholder",
    "video_placeholder",
    "ignore_index",
    *_INERT,
}
_WRAPPER_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


class _KeyError(ValueError):
    """A config.json key is wrong; `config_from_hf` adds the file it came from."""


def _fail(where: str, why: str) -> ValueError:
    return _KeyError(f"{where}: {why}")


def _key_of(field: str, vl_wrapper: bool) -> str:
    """The config.json key (with its section) that sets K3Config `field`, for error messages."""
    if field.startswith("vision_config") or field == "media_placeholder_token_id":
        return field  # the wrapper's own keys, beside text_config
    at = "text_config." if vl_wrapper else ""
    for fname, key, _ in _TEXT_KEYS:
        if fname == field:
            return at + key
    for fname, key in _FEATURE_KEYS:
        if fname == field:
            return at + key
    for fname, key in _LINEAR_KEYS:
        if fname == field:
            return f"{at}linear_attn_config.{key}"
    if field == "kda_gate_lower_bound":
        return f"{at}linear_attn_config.gate_lower_bound"
    if field == "layer_kinds":
        return f"{at}linear_attn_config"
    return at + field


def _get(d: dict[str, Any], key: str, aliases: tuple[str, ...] = ()) -> tuple[bool, Any]:
    for k in (key, *aliases):
        if k in d:
            return True, d[k]
    return False, None


def _layer_kinds(text: dict[str, Any], at: str) -> tuple[str, ...]:
    lac = text.get("linear_attn_config") or {}
    n = text.get("num_hidden_layers")
    if "kda_layers" in lac and "full_attn_layers" in lac:
        n = n or len(lac["kda_layers"]) + len(lac["full_attn_layers"])
        kinds: list[str | None] = [None] * n
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            for one_based in lac[key]:
                if not isinstance(one_based, int) or not 1 <= one_based <= n:
                    raise _fail(f"{at}linear_attn_config.{key}", f"layer {one_based!r} outside 1..{n}")
                if kinds[one_based - 1] is not None:
                    raise _fail(f"{at}linear_attn_config.{key}", f"layer {one_based} is assigned twice")
                kinds[one_based - 1] = kind
        missing = [i + 1 for i, k in enumerate(kinds) if k is None]
        if missing:
            raise _fail(f"{at}linear_attn_config", f"layers {missing} are neither kda_layers nor full_attn_layers")
        return tuple(kinds)  # type: ignore[arg-type]
    if "layer_types" in text:
        table = {"linear_attention": "kda", "full_attention": "mla"}
        try:
            return tuple(table[t] for t in text["layer_types"])
        except (KeyError, TypeError) as e:
            raise _fail(f"{at}layer_types", f"unknown layer type {e.args[0]!r}") from None
    raise _fail(at or "(top level)", "needs linear_attn_config.{kda_layers, full_attn_layers} or layer_types")


def _check_quantization(q: Any, at: str) -> bool:
    """True for compressed-tensors MXFP4 (which tensors are packed is read off the tensors themselves)."""
    if not q:
        return False
    if not isinstance(q, dict):
        raise _fail(at, "must be an object")
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != MXFP4_FORMAT:
        raise _fail(
            at,
            f"unsupported quantization (quant_method={method!r}, format={fmt!r}); only "
            f"compressed-tensors {MXFP4_FORMAT!r} routed experts are supported",
        )
    for name, group in (q.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        for key, want in (("num_bits", 4), ("group_size", 32), ("type", "float")):
            if key in weights and weights[key] != want:
                raise _fail(f"{at}.config_groups.{name}.weights.{key}", f"MXFP4 needs {want!r}, got {weights[key]!r}")
        if group.get("format", fmt) != MXFP4_FORMAT:
            raise _fail(f"{at}.config_groups.{name}.format", f"must be {MXFP4_FORMAT!r}, got {group.get('format')!r}")
    return True


def _text_fields(text: dict[str, Any], at: str) -> dict[str, Any]:
    """K3Config keyword arguments from a text config; ValueError names any key not understood."""
    mt = text.get("model_type", TEXT_MODEL_TYPE)
    if mt != TEXT_MODEL_TYPE:
        raise _fail(f"{at}model_type", f"expected {TEXT_MODEL_TYPE!r} (the K3 / Kimi-Linear text model), got {mt!r}")
    kw: dict[str, Any] = {}
    for fname, key, aliases in _TEXT_KEYS:
        found, val = _get(text, key, aliases)
        if found:
            kw[fname] = val
    for fname, key in _FEATURE_KEYS:
        if text.get(key) is not None:
            kw[fname] = text[key]
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise _fail(f"{at}linear_attn_config", "must be an object")
    for fname, key in _LINEAR_KEYS:
        found, val = _get(lac, key)
        if not found:
            found, val = _get(text, _LINEAR_ALIASES[key])
        if found:
            kw[fname] = val
    if lac.get("gate_lower_bound") is not None:
        kw["kda_gate_form"], kw["kda_gate_lower_bound"] = "lower_bound", lac["gate_lower_bound"]
    else:
        kw["kda_gate_form"] = "softplus"
    kw["kda_output_gate"] = "full" if lac.get("use_full_rank_gate") else "low_rank"
    kw.setdefault("hidden_act", "silu")
    kw["layer_kinds"] = _layer_kinds(text, at)
    if "mlp_layer_types" in text and "first_k_dense_replace" not in text:
        types = list(text["mlp_layer_types"])
        n_dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if any(t != "sparse" for t in types[n_dense:]):
            raise _fail(f"{at}mlp_layer_types", "only a dense prefix followed by sparse layers is supported")
        kw["first_dense_layers"] = n_dense
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0] if kw["eos_token_id"] else None
    method = text.get("topk_method", "noaux_tc")
    if method not in _TOPK_METHODS:
        raise _fail(f"{at}topk_method", f"must be one of {sorted(_TOPK_METHODS)}, got {method!r}")
    kw["router_correction_bias"] = _TOPK_METHODS[method]
    for key, want in {**_FIXED, **_FIXED_UNWRITTEN}.items():
        if key in text and text[key] != want:
            raise _fail(f"{at}{key}", f"only {json.dumps(want)} is implemented, got {json.dumps(text[key])}")
    if text.get("use_grouped_topk") is False and kw.get("num_expert_group", 1) > 1:
        raise _fail(f"{at}use_grouped_topk", "false with num_expert_group > 1 is not implemented")
    heads = text.get("num_key_value_heads")
    if heads is not None and heads != kw.get("mla_num_heads", heads):
        raise _fail(
            f"{at}num_key_value_heads",
            "MLA expands one latent to all heads; it must equal "
            f"num_attention_heads ({kw.get('mla_num_heads')}), got {heads}",
        )
    n = text.get("num_hidden_layers")
    if n is not None and n != len(kw["layer_kinds"]):
        raise _fail(
            f"{at}num_hidden_layers",
            f"{n} disagrees with the {len(kw['layer_kinds'])} layers of linear_attn_config / layer_types",
        )
    if kw["hidden_act"] not in ACTIVATIONS:
        raise _fail(f"{at}hidden_act", f"must be one of {ACTIVATIONS}, got {kw['hidden_act']!r}")
    if kw["hidden_act"] != "situ" and ("activation_situ_beta" in text or "activation_situ_linear_beta" in text):
        raise _fail(f"{at}activation_situ_beta", f"set, but hidden_act is {kw.get('hidden_act')!r}, not 'situ'")
    if text.get("latent_moe_use_norm") and text.get("routed_expert_hidden_size") is None:
        raise _fail(f"{at}latent_moe_use_norm", "needs routed_expert_hidden_size (the latent width)")
    known = {key for _, key, al in _TEXT_KEYS for key in (key, *al)} | {k for _, k in _FEATURE_KEYS}
    known |= _FIXED.keys() | _FIXED_UNWRITTEN.keys() | _DERIVED
    unknown = sorted(set(text) - known - _INERT)
    if unknown:
        raise _fail(
            f"{at}{unknown[0]}",
            "not a key of the Kimi K3 / Kimi-Linear schema (a typo, or a feature this loader does not implement)",
        )
    bad = sorted(set(lac) - _LINEAR_OWN - {k for _, k in _LINEAR_KEYS})
    if bad:
        raise _fail(f"{at}linear_attn_config.{bad[0]}", "not a key of the Kimi K3 / Kimi-Linear schema")
    kw["hf_text_extras"] = {k: v for k, v in text.items() if k in _INERT}
    return kw


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> K3Config:
    """Parse a config.json dict (Kimi K3 or Kimi-Linear). ValueError names `source` and the offending key."""
    try:
        kw = _fields_from_hf(d)
    except _KeyError as e:
        raise ValueError(f"{source} {e}") from None
    try:
        return K3Config(**kw)
    except ValueError as e:  # "K3Config.<field>: why": name the key that set the field instead
        field, _, why = str(e).removeprefix("K3Config.").partition(": ")
        raise ValueError(f"{source} {_key_of(field, kw['vl_wrapper'])}: {why}") from None


def _fields_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise _fail("(top level)", "expected a JSON object")
    top_type = d.get("model_type")
    if top_type == K3_MODEL_TYPE:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise _fail("text_config", "a kimi_k3 config needs the language model's config as an object")
        kw = _text_fields(text, "text_config.")
        for key in _WRAPPER_TOKENS:
            if d.get(key) is not None and text.get(key) is not None and d[key] != text[key]:
                raise _fail(key, f"{d[key]!r} differs from text_config.{key} {text[key]!r}")
            if d.get(key) is not None and text.get(key) is None:
                kw[key] = d[key][0] if isinstance(d[key], list) and d[key] else d[key]
        if "tie_word_embeddings" in d:
            if "tie_word_embeddings" in text and d["tie_word_embeddings"] != text["tie_word_embeddings"]:
                raise _fail("tie_word_embeddings", "differs from text_config.tie_word_embeddings")
            kw["tie_word_embeddings"] = d["tie_word_embeddings"]
        arch = d.get("architectures") or [K3_ARCHITECTURE]
        if arch != [K3_ARCHITECTURE]:
            raise _fail("architectures", f"expected [{K3_ARCHITECTURE!r}], got {arch!r}")
        top_q, text_q = d.get("quantization_config"), text.get("quantization_config")
        if top_q and text_q and top_q != text_q:
            raise _fail("quantization_config", "differs from text_config.quantization_config")
        kw["experts_mxfp4"] = _check_quantization(text_q or top_q, "text_config.quantization_config")
        known = {
            "model_type",
            "text_config",
            "architectures",
            "quantization_config",
            "tie_word_embeddings",
            *_WRAPPER_TOKENS,
        }
        unknown = sorted(set(d) - known - _WRAPPER_INERT)
        if unknown:
            raise _fail(unknown[0], "not a key of the Kimi K3 config schema")
        kw["hf_wrapper_extras"] = {k: v for k, v in d.items() if k in _WRAPPER_INERT}
        kw["vl_wrapper"] = True
    elif top_type in (TEXT_MODEL_TYPE, None):
        if top_type is None:
            raise _fail("model_type", f"missing (expected {K3_MODEL_TYPE!r} or {TEXT_MODEL_TYPE!r})")
        if "text_config" in d:
            raise _fail("text_config", f"a nested text config needs model_type {K3_MODEL_TYPE!r} at the top")
        arch = d.get("architectures") or [TEXT_ARCHITECTURE]
        if arch != [TEXT_ARCHITECTURE]:
            raise _fail("architectures", f"expected [{TEXT_ARCHITECTURE!r}], got {arch!r}")
        kw = _text_fields(d, "")
        kw["experts_mxfp4"] = _check_quantization(d.get("quantization_config"), "quantization_config")
        kw["vl_wrapper"] = False
    else:
        raise _fail("model_type", f"expected {K3_MODEL_TYPE!r} or {TEXT_MODEL_TYPE!r}, got {top_type!r}")
    return kw


def quantization_config() -> dict[str, Any]:
    """compressed-tensors MXFP4 as K3 ships it: the rule targets every Linear outside `ignore`, while the
    tensors hold only the routed experts' w1/w2/w3 packed (the latent down/up projections stay bf16)."""
    return {
        "config_groups": {
            "group_0": {
                "format": MXFP4_FORMAT,
                "targets": ["Linear"],
                "weights": {
                    "dynamic": False,
                    "group_size": 32,
                    "num_bits": 4,
                    "observer": "minmax",
                    "scale_dtype": "torch.uint8",
                    "strategy": "group",
                    "symmetric": True,
                    "type": "float",
                },
            }
        },
        "format": MXFP4_FORMAT,
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _text_dict(c: K3Config) -> dict[str, Any]:
    text: dict[str, Any] = dict(c.hf_text_extras)
    text.update({key: getattr(c, fname) for fname, key, _ in _TEXT_KEYS})
    if not c.vl_wrapper:  # transformers' KimiLinearConfig spells it so
        text["model_max_length"] = text.pop("max_position_embeddings")
    on = {
        "mla_output_gate": c.mla_output_gate,
        "attn_res_block_size": c.attn_res_block_size > 0,
        "moe_latent_size": c.moe_latent_size is not None,
        "moe_latent_norm": c.moe_latent_norm,
        "situ_beta": c.hidden_act == "situ",
        "situ_beta_lin": c.hidden_act == "situ",
    }
    text.update({key: getattr(c, fname) for fname, key in _FEATURE_KEYS if on[fname]})
    text.update(_FIXED)
    text.update(
        {
            "model_type": TEXT_MODEL_TYPE,
            "architectures": [TEXT_ARCHITECTURE],
            "num_hidden_layers": c.num_hidden_layers,
            "num_key_value_heads": c.mla_num_heads,
            "topk_method": "noaux_tc" if c.router_correction_bias else "greedy",
            "use_grouped_topk": True,
        }
    )
    lac: dict[str, Any] = {key: getattr(c, fname) for fname, key in _LINEAR_KEYS}
    lac["kda_layers"] = [i + 1 for i, k in enumerate(c.layer_kinds) if k == "kda"]
    lac["full_attn_layers"] = [i + 1 for i, k in enumerate(c.layer_kinds) if k == "mla"]
    if c.kda_gate_form == "lower_bound":
        lac["gate_lower_bound"] = c.kda_gate_lower_bound
    if c.kda_output_gate == "full":
        lac["use_full_rank_gate"] = True
    text["linear_attn_config"] = lac
    if c.experts_mxfp4:
        text["quantization_config"] = quantization_config()
    return text


def config_to_hf(c: K3Config) -> dict[str, Any]:
    """The config.json content: K3's wrapper iff `vl_wrapper`, else flat Kimi-Linear."""
    text = _text_dict(c)
    if not c.vl_wrapper:
        return text
    out: dict[str, Any] = dict(c.hf_wrapper_extras)
    out.update(
        {
            "architectures": [K3_ARCHITECTURE],
            "model_type": K3_MODEL_TYPE,
            "text_config": text,
            "tie_word_embeddings": c.tie_word_embeddings,
        }
    )
    out.update({key: getattr(c, key) for key in _WRAPPER_TOKENS})
    return out
