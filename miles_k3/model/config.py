"""K3Config: every hyperparameter of the Kimi K3 family, one dataclass.

The same config describes Kimi K3 (hybrid KDA + NoPE MLA, Attention Residuals,
LatentMoE with SiTU) and Kimi-Linear (K3 without AttnRes, LatentMoE and SiTU),
so transformers' `KimiLinearForCausalLM` can serve as an external oracle.

It reads and writes HF `config.json` in the published schemas (see
`miles_k3.model.hf_config`): Kimi K3's (`model_type: kimi_k3`, the text model
nested under `text_config`, weights prefixed `language_model.`) and
Kimi-Linear's flat one. Field names here are ours; the config.json keys are
the published ones, and what a config.json cannot say (the A_log layout, the
MLA latent-norm eps, the shared-expert width) is derived, not stored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_k3.model.checks import is_int as _is_int
from miles_k3.model.checks import is_number as _is_number
from miles_k3.model.vision_config import VisionConfig

LAYER_KINDS = ("kda", "mla")
GATE_FORMS = ("lower_bound", "softplus")
OUTPUT_GATE_FORMS = ("full", "low_rank")
ACTIVATIONS = ("situ", "silu")


def hybrid_layer_kinds(num_layers: int, mla_every: int = 4) -> tuple[str, ...]:
    """K3 / Kimi-Linear placement: MLA at 1-indexed layers mla_every, 2*mla_every, ... and the last."""
    return tuple("mla" if (i + 1) % mla_every == 0 or i == num_layers - 1 else "kda" for i in range(num_layers))


@dataclass
class K3Config:
    """Hyperparameters of a K3-family model. Validated on construction (ValueError names the field)."""

    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # KDA (Kimi Delta Attention)
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    kda_conv_kernel: int = 4
    # K3 (`linear_attn_config.gate_lower_bound` present): lower_bound * sigmoid(exp(A_log) f), and A_log
    # stored [max(head_dim, H)] with the heads zero-padded; Kimi-Linear: -exp(A_log) softplus(f), A_log
    # stored [1, 1, H, 1] (`miles_k3.model.layout.kda_a_log_shape`)
    kda_gate_form: str = "softplus"
    kda_gate_lower_bound: float = -5.0
    kda_output_gate: str = "low_rank"  # K3 (`use_full_rank_gate`): g_proj; Kimi-Linear: g_b_proj(g_a_proj(x))

    # MLA without rotary embedding
    mla_num_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = False  # `mla_use_output_gate`: attn * sigmoid(g_proj(x)) before o_proj

    # Attention Residuals (arXiv 2603.15031); block size 0 disables them (plain residual stream)
    attn_res_block_size: int = 0

    # MLP / MoE
    first_dense_layers: int = 1
    dense_intermediate_size: int = 9216
    num_experts: int = 256
    num_experts_per_token: int = 8
    moe_intermediate_size: int = 1024
    num_shared_experts: int = 1  # one GLU of width moe_intermediate_size * num_shared_experts
    moe_latent_size: int | None = None  # `routed_expert_hidden_size`: LatentMoE width; None = hidden_size
    moe_latent_norm: bool = False  # `latent_moe_use_norm`: RMSNorm of the experts' output at the latent width
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    router_correction_bias: bool = True  # `topk_method: noaux_tc` (e_score_correction_bias); "greedy": none
    num_expert_group: int = 1
    topk_group: int = 1
    hidden_act: str = "silu"
    situ_beta: float = 4.0  # `activation_situ_beta`
    situ_beta_lin: float = 25.0  # `activation_situ_linear_beta`

    # Checkpoint form: Kimi K3's vision-language wrapper (`model_type: kimi_k3`) nests the text config
    # under `text_config` and prefixes the text weights with `language_model.`
    vl_wrapper: bool = False
    # compressed-tensors MXFP4 for routed experts in the checkpoint (the in-memory model is dense)
    experts_mxfp4: bool = False

    # config.json keys that do not change the text model, carried through a read/write unchanged: HF's
    # generic keys (`use_cache`, `dtype`, ...) of the text config, and the wrapper's own (`vision_config`,
    # `media_placeholder_token_id`, `image_placeholder`, `ignore_index`, ...). Not compared.
    hf_text_extras: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    hf_wrapper_extras: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.layer_kinds = tuple(self.layer_kinds)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def gate_rank(self) -> int:
        """Rank of f_a_proj / f_b_proj (and of g_a / g_b in the low-rank output gate): the head dim."""
        return self.kda_head_dim

    @property
    def shared_intermediate(self) -> int:
        """Width of the shared-expert GLU: K3 and Kimi-Linear fuse their shared experts into one."""
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def mla_latent_norm_eps(self) -> float:
        """eps of q_a_layernorm / kv_a_layernorm: fixed at 1e-6 by K3 and Kimi-Linear, not rms_norm_eps."""
        return 1e-6

    @property
    def expert_width(self) -> int:
        """Width at which routed experts run: the latent width for LatentMoE, else hidden_size."""
        return self.moe_latent_size if self.moe_latent_size is not None else self.hidden_size

    @property
    def res_eps(self) -> float:
        """eps of the AttnRes key norms: the model's rms_norm_eps."""
        return self.rms_norm_eps

    @property
    def vision_config(self) -> VisionConfig | None:
        """The vision tower's config (the wrapper's `vision_config`, parsed; checked when this config is made),
        None for a text-only config."""
        d = self.hf_wrapper_extras.get("vision_config")
        return None if d is None else VisionConfig.from_hf_dict(d)

    @property
    def media_placeholder_token_id(self) -> int | None:
        """The `<|media_pad|>` token id whose embeddings image features replace; None if the config has none."""
        return self.hf_wrapper_extras.get("media_placeholder_token_id")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_dense_layers and self.num_experts > 0

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ValueError(f"K3Config.{name}: {why} (got {getattr(self, name, None)!r})")

        for f in dataclasses.fields(self):  # types first, so the rules below compare numbers with numbers
            ok = _TYPE_CHECKS.get(f.type)
            need(ok is None or ok(getattr(self, f.name)), f.name, f"must be {f.type}")

        for name in (
            "vocab_size",
            "hidden_size",
            "kda_num_heads",
            "kda_head_dim",
            "kda_conv_kernel",
            "mla_num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "dense_intermediate_size",
            "max_position_embeddings",
        ):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "must be a positive int")
        need(len(self.layer_kinds) > 0, "layer_kinds", "needs at least one layer")
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS]
        need(not bad, "layer_kinds", f"entries must be one of {LAYER_KINDS}, found {sorted(set(bad))}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
        need(self.kda_gate_form in GATE_FORMS, "kda_gate_form", f"must be one of {GATE_FORMS}")
        need(self.kda_output_gate in OUTPUT_GATE_FORMS, "kda_output_gate", f"must be one of {OUTPUT_GATE_FORMS}")
        if self.kda_gate_form == "lower_bound":
            need(self.kda_gate_lower_bound < 0, "kda_gate_lower_bound", "must be < 0 (a log-space decay bound)")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "must be > 0 or None")
        need(self.attn_res_block_size >= 0, "attn_res_block_size", "must be >= 0 (0 disables AttnRes)")
        need(
            0 <= self.first_dense_layers <= self.num_hidden_layers,
            "first_dense_layers",
            f"must be in [0, {self.num_hidden_layers}]",
        )
        need(self.num_experts >= 0, "num_experts", "must be >= 0")
        if self.first_dense_layers < self.num_hidden_layers:
            need(self.num_experts > 0, "num_experts", "MoE layers exist (first_dense_layers < layers) but no experts")
            need(
                0 < self.num_experts_per_token <= self.num_experts,
                "num_experts_per_token",
                f"must be in [1, num_experts={self.num_experts}]",
            )
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0")
            need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
            need(
                self.num_expert_group > 0 and self.num_experts % self.num_expert_group == 0,
                "num_expert_group",
                f"must divide num_experts={self.num_experts}",
            )
            need(
                0 < self.topk_group <= self.num_expert_group,
                "topk_group",
                f"must be in [1, num_expert_group={self.num_expert_group}]",
            )
            need(
                self.num_experts_per_token <= self.topk_group * self.num_experts // self.num_expert_group,
                "num_experts_per_token",
                "exceeds the experts available in the selected groups",
            )
            need(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
        need(self.moe_latent_size is None or self.moe_latent_size > 0, "moe_latent_size", "must be > 0 or None")
        need(
            not (self.moe_latent_norm and self.moe_latent_size is None),
            "moe_latent_norm",
            "a latent norm needs moe_latent_size",
        )
        if self.experts_mxfp4:
            for name in ("expert_width", "moe_intermediate_size"):
                need(getattr(self, name) % 32 == 0, "experts_mxfp4", f"MXFP4 blocks of 32 need {name} % 32 == 0")
        need(self.hidden_act in ACTIVATIONS, "hidden_act", f"must be one of {ACTIVATIONS}")
        need(self.situ_beta > 0 and self.situ_beta_lin > 0, "situ_beta", "SiTU betas must be > 0")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            need(v is None or 0 <= v < self.vocab_size, name, f"must lie in [0, vocab_size={self.vocab_size})")
        media = self.media_placeholder_token_id
        if media is not None and not (_is_int(media) and 0 <= media < self.vocab_size):
            raise ValueError(
                f"K3Config.media_placeholder_token_id: must be an int in [0, vocab_size="
                f"{self.vocab_size}) (got {media!r})"
            )
        try:  # a bad vision key fails here, by name, before any model is built
            self.vision_config
        except ValueError as e:
            raise ValueError(f"K3Config.{e}") from None

    # ----------------------------------------------------------------- presets
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "K3Config":
        """Named configurations: k3, kimi-linear-48b-a3b, k3-small, k3-tiny, k3-tiny-vl (see PRESETS)."""
        if name not in PRESETS:
            raise ValueError(f"unknown K3 preset {name!r}; known: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name](), **overrides)

    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)

    def kimi_linear_form(self) -> "K3Config":
        """The nearest config transformers' KimiLinear runs: the same widths without K3's features (softplus
        KDA gate, low-rank output gate, no MLA output gate, AttnRes, LatentMoE or SiTU; plain q_proj; flat
        checkpoint, dense experts)."""
        return self.replace(
            kda_gate_form="softplus",
            kda_output_gate="low_rank",
            mla_output_gate=False,
            attn_res_block_size=0,
            moe_latent_size=None,
            moe_latent_norm=False,
            hidden_act="silu",
            vl_wrapper=False,
            experts_mxfp4=False,
            q_lora_rank=None,
            hf_wrapper_extras={},
        )

    # ---------------------------------------------------------------- counting
    def num_parameters(self) -> int:
        """Total parameters of the logical (dense, unquantized) model."""
        from miles_k3.model.layout import tensor_shapes

        return sum(math.prod(s) for s in tensor_shapes(self).values())

    def num_active_parameters(self) -> int:
        """Parameters touched per token: all but the routed experts a token does not select."""
        from miles_k3.model.layout import is_routed_expert_tensor, tensor_shapes

        routed = sum(math.prod(s) for n, s in tensor_shapes(self).items() if is_routed_expert_tensor(n))
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        active_routed = routed * self.num_experts_per_token // self.num_experts if moe_layers else 0
        return self.num_parameters() - routed + active_routed

    # ------------------------------------------------------------------ HF I/O
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content, in the wrapper layout iff `vl_wrapper`."""
        from miles_k3.model.hf_config import config_to_hf

        return config_to_hf(self)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "K3Config":
        """Parse a config.json dict; a ValueError names `source` and the offending key."""
        from miles_k3.model.hf_config import config_from_hf

        return config_from_hf(d, source)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "K3Config":
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        except OSError as e:
            raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
        return cls.from_hf_dict(d, str(path))

    def to_json_file(self, path: str | Path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_hf_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


def _k3() -> K3Config:
    return K3Config(
        vocab_size=163840,
        hidden_size=7168,
        layer_kinds=hybrid_layer_kinds(93),
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        kda_num_heads=96,
        kda_head_dim=128,
        kda_gate_form="lower_bound",
        kda_gate_lower_bound=-5.0,
        kda_output_gate="full",
        mla_num_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_output_gate=True,
        attn_res_block_size=12,
        first_dense_layers=1,
        dense_intermediate_size=33792,
        num_experts=896,
        num_experts_per_token=16,
        moe_intermediate_size=3072,
        num_shared_experts=2,
        moe_latent_size=3584,
        moe_latent_norm=True,
        routed_scaling_factor=1.0,
        hidden_act="situ",
        vl_wrapper=True,
        experts_mxfp4=True,
        hf_wrapper_extras=_k3_wrapper_extras(),
    )


# Field type (as annotated) -> check; fields of other types are checked by the rules in `validate`.
_TYPE_CHECKS = {
    "int": _is_int,
    "float": _is_number,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "int | None": lambda v: v is None or _is_int(v),
    "float | None": lambda v: v is None or _is_number(v),
}


def _k3_wrapper_extras() -> dict[str, Any]:
    """The published K3 config.json's keys beside `text_config`: the vision tower and the media tokens
    (read by the vision path; carried through unchanged by the text model)."""
    return {
        "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "media_placeholder_token_id": 163605,
        "vision_config": {
            "_attn_implementation": "flash_attention_2",
            "activation_func": "gelu_pytorch_tanh",
            "attn_bias": False,
            "init_pos_emb_height": 64,
            "init_pos_emb_time": 4,
            "init_pos_emb_width": 64,
            "linear_bias": False,
            "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool",
            "mlp_type": "mlp2",
            "mm_hidden_size": 1024,
            "mm_projector_type": "patchmergerv2",
            "norm_type": "rmsnorm",
            "patch_embed_proj_bias": False,
            "patch_size": 14,
            "pos_emb_interpolation_mode": "bilinear",
            "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05,
            "qkv_hidden_size": 1536,
            "text_hidden_size": 7168,
            "vt_hidden_size": 1024,
            "vt_intermediate_size": 4096,
            "vt_num_attention_heads": 12,
            "vt_num_hidden_layers": 27,
        },
    }


def _kimi_linear_48b() -> K3Config:
    return K3Config(
        vocab_size=163840,
        hidden_size=2304,
        layer_kinds=hybrid_layer_kinds(27),
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        kda_num_heads=32,
        kda_head_dim=128,
        kda_gate_form="softplus",
        kda_output_gate="low_rank",
        mla_num_heads=32,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_output_gate=False,
        first_dense_layers=1,
        dense_intermediate_size=9216,
        num_experts=256,
        num_experts_per_token=8,
        moe_intermediate_size=1024,
        num_shared_experts=1,
        routed_scaling_factor=2.446,
        hidden_act="silu",
    )


def _k3_small() -> K3Config:
    # ~1.1B total: fits one H200 next to a rollout engine; same structure as k3, scaled down.
    return K3Config(
        vocab_size=163840,
        hidden_size=1024,
        layer_kinds=hybrid_layer_kinds(16),
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        kda_num_heads=8,
        kda_head_dim=128,
        kda_gate_form="lower_bound",
        kda_output_gate="full",
        mla_num_heads=8,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_output_gate=True,
        attn_res_block_size=4,
        first_dense_layers=1,
        dense_intermediate_size=4096,
        num_experts=64,
        num_experts_per_token=4,
        moe_intermediate_size=384,
        num_shared_experts=2,
        moe_latent_size=512,
        moe_latent_norm=True,
        hidden_act="situ",
        vl_wrapper=True,
        experts_mxfp4=True,
    )


def _k3_tiny() -> K3Config:
    # A few million parameters: trains on a 2-core CPU. Small AttnRes blocks so the bank is exercised.
    return K3Config(
        vocab_size=512,
        hidden_size=128,
        layer_kinds=hybrid_layer_kinds(6, mla_every=3),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        kda_num_heads=4,
        kda_head_dim=32,
        kda_gate_form="lower_bound",
        kda_output_gate="full",
        mla_num_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        mla_output_gate=True,
        attn_res_block_size=2,
        first_dense_layers=1,
        dense_intermediate_size=384,
        num_experts=16,
        num_experts_per_token=4,
        moe_intermediate_size=64,
        num_shared_experts=2,
        moe_latent_size=64,
        moe_latent_norm=True,
        hidden_act="situ",
        vl_wrapper=True,
        experts_mxfp4=False,
        max_position_embeddings=4096,
    )


# k3-tiny-vl's `<|media_pad|>` id: the tiny VL tokenizer (miles_k3/tasks/squares.py) must give the pad this id.
TINY_MEDIA_PAD_ID = 3


def _k3_tiny_vl() -> K3Config:
    # k3-tiny's text model and a ~0.2M-parameter tower: 14-pixel patches, 8 x 8 position table (112-pixel
    # images without interpolation), 2 x 2 merge into the 128-wide text model. Trains on a 2-core CPU.
    vision = VisionConfig(
        vt_hidden_size=64,
        vt_num_hidden_layers=2,
        vt_num_attention_heads=4,
        qkv_hidden_size=64,
        vt_intermediate_size=128,
        patch_size=14,
        init_pos_emb_height=8,
        init_pos_emb_width=8,
        init_pos_emb_time=4,
        mm_hidden_size=64,
        text_hidden_size=128,
    )
    extras = {"media_placeholder_token_id": TINY_MEDIA_PAD_ID, "vision_config": vision.to_hf_dict()}
    return _k3_tiny().replace(hf_wrapper_extras=extras)


PRESETS = {
    "k3": _k3,
    "kimi-linear-48b-a3b": _kimi_linear_48b,
    "k3-small": _k3_small,
    "k3-tiny": _k3_tiny,
    "k3-tiny-vl": _k3_tiny_vl,
}
