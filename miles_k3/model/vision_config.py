"""VisionConfig: K3's vision tower (MoonViT3d) and projector (PatchMergerMLPV2), the `vision_config` of the
K3 config.json.

Field names are the published config.json keys, so reading and writing is a copy: no key table to keep in
step. Defaults are the released K3 tower's values. Keys with the one value we implement (`_FIXED`: RMSNorm
blocks, bias-free linears, the sd2_tpool merge, ...) are checked on read and always written; every other
key (`_attn_implementation`, `model_type`, keys of later releases) is carried through a read/write
unchanged in `extras`. Nothing here reads or knows the text model: `K3Config.vision_config` parses the
wrapper's dict into this class, and `K3VisionModel` checks `text_hidden_size` against the text config
when both meet.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from miles_k3.model.checks import is_int as _is_int
from miles_k3.model.checks import is_number as _is_number

TOWER_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # the blocks' MLP activation: tanh-approximate or exact GELU
INTERPOLATIONS = ("bilinear", "bicubic")  # how the position table is resized to an image's patch grid
ROPE_MAX_GRID = 512  # the released tower's 2-D rotary table covers grids up to 512 x 512 patches
# key: the one value implemented (a config that says otherwise asks for a tower we do not build)
_FIXED: dict[str, Any] = {
    "pos_emb_type": "divided_fixed",  # learned [H0, W0, D] spatial table + fixed sincos time term
    "norm_type": "rmsnorm",
    "mlp_type": "mlp2",  # fc0 -> activation -> fc1
    "merge_type": "sd2_tpool",  # kh x kw spatial merge, mean over time
    "mm_projector_type": "patchmergerv2",  # linear -> GELU -> linear -> RMSNorm
    "projector_hidden_act": "gelu",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
}


@dataclass(frozen=True)
class VisionConfig:
    """Hyperparameters of K3's vision tower and projector. Validated on construction (ValueError naming
    `vision_config.<key>`)."""

    vt_hidden_size: int = 1024  # the tower's residual width D
    vt_num_hidden_layers: int = 27  # encoder blocks
    vt_num_attention_heads: int = 12  # attention heads per block
    qkv_hidden_size: int = 1536  # width of each of q, k, v (heads x head_dim); wqkv is D -> 3 x this
    vt_intermediate_size: int = 4096  # MLP width (fc0: D -> this, fc1: back)
    activation_func: str = "gelu_pytorch_tanh"  # the MLP activation, one of TOWER_ACTIVATIONS
    patch_size: int = 14  # pixels per patch side; a patch is [3, p, p]
    init_pos_emb_height: int = 64  # rows H0 of the learned position table [H0, W0, D]
    init_pos_emb_width: int = 64  # columns W0 of the learned position table
    init_pos_emb_time: int = 4  # most frames per media item (the sincos time term's length)
    pos_emb_interpolation_mode: str = "bilinear"  # resizing of the table to an image's grid (INTERPOLATIONS)
    merge_kernel_size: tuple[int, int] = (2, 2)  # (kh, kw) patches merged into one token
    mm_hidden_size: int = 1024  # the projector's per-patch input width: the tower's D
    text_hidden_size: int = 7168  # the projector's output width: the text model's hidden size
    projector_ln_eps: float = 1e-5  # eps of the projector's output RMSNorm (the tower's norms use the dtype's)
    # keys not understood (carried through unchanged), e.g. `_attn_implementation`; not compared
    extras: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "merge_kernel_size", _pair(self.merge_kernel_size))
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        """Patches per merged token: kh * kw."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def projector_width(self) -> int:
        """The projector's input and hidden width: a merged token's kh * kw patches concatenated."""
        return self.mm_hidden_size * self.merge_area

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the tower and projector as the checkpoint names them (unprefixed by the
        wrapper: `vision_tower.*`, `mm_projector.*`) -> shape. `K3VisionModel(cfg).state_dict()` has
        exactly these keys and shapes."""
        d, p, q, m = self.vt_hidden_size, self.patch_size, self.qkv_hidden_size, self.projector_width
        shapes: dict[str, tuple[int, ...]] = {
            "vision_tower.patch_embed.proj.weight": (d, 3, p, p),
            "vision_tower.patch_embed.pos_emb.weight": (self.init_pos_emb_height, self.init_pos_emb_width, d),
        }
        for i in range(self.vt_num_hidden_layers):
            b = f"vision_tower.encoder.blocks.{i}."
            shapes.update(
                {
                    b + "norm0.weight": (d,),
                    b + "norm1.weight": (d,),
                    b + "wqkv.weight": (3 * q, d),
                    b + "wo.weight": (d, q),
                    b + "mlp.fc0.weight": (self.vt_intermediate_size, d),
                    b + "mlp.fc1.weight": (d, self.vt_intermediate_size),
                }
            )
        shapes["vision_tower.encoder.final_layernorm.weight"] = (d,)
        shapes.update(
            {
                "mm_projector.proj.0.weight": (m, m),
                "mm_projector.proj.2.weight": (self.text_hidden_size, m),
                "mm_projector.post_norm.weight": (self.text_hidden_size,),
            }
        )
        return shapes

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ValueError(f"vision_config.{name}: {why} (got {getattr(self, name)!r})")

        for f in dataclasses.fields(self):  # types first, so the rules below compare numbers with numbers
            ok = _TYPE_CHECKS.get(f.type)
            need(ok is None or ok(getattr(self, f.name)), f.name, f"must be {f.type}")
        for name in (
            "vt_hidden_size",
            "vt_num_hidden_layers",
            "vt_num_attention_heads",
            "qkv_hidden_size",
            "vt_intermediate_size",
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "init_pos_emb_time",
            "mm_hidden_size",
            "text_hidden_size",
        ):
            need(getattr(self, name) > 0, name, "must be a positive int")
        need(
            self.qkv_hidden_size % self.vt_num_attention_heads == 0,
            "qkv_hidden_size",
            f"must divide into vt_num_attention_heads={self.vt_num_attention_heads} heads",
        )
        need(
            self.head_dim % 4 == 0,
            "qkv_hidden_size",
            f"the 2-D rotary embedding needs head_dim % 4 == 0 (head_dim {self.head_dim})",
        )
        need(
            self.mm_hidden_size == self.vt_hidden_size,
            "mm_hidden_size",
            f"the projector reads the tower's output: must equal vt_hidden_size={self.vt_hidden_size}",
        )
        need(self.activation_func in TOWER_ACTIVATIONS, "activation_func", f"must be one of {TOWER_ACTIVATIONS}")
        need(
            self.pos_emb_interpolation_mode in INTERPOLATIONS,
            "pos_emb_interpolation_mode",
            f"must be one of {INTERPOLATIONS}",
        )
        need(
            all(_is_int(k) and k > 0 for k in self.merge_kernel_size),
            "merge_kernel_size",
            "must be two positive ints [kh, kw]",
        )
        need(self.projector_ln_eps > 0, "projector_ln_eps", "must be > 0")

    def replace(self, **changes: Any) -> "VisionConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: Any) -> "VisionConfig":
        """Parse a `vision_config` dict; ValueError names `vision_config.<key>`."""
        if not isinstance(d, dict):
            raise ValueError(f"vision_config: must be an object (got {type(d).__name__})")
        names = {f.name for f in dataclasses.fields(cls)} - {"extras"}
        for key, want in _FIXED.items():
            if key in d and d[key] != want:
                raise ValueError(f"vision_config.{key}: only {want!r} is implemented (got {d[key]!r})")
        if "merge_kernel_size" in d and not (
            isinstance(d["merge_kernel_size"], (list, tuple)) and len(d["merge_kernel_size"]) == 2
        ):
            raise ValueError(
                f"vision_config.merge_kernel_size: must be two positive ints [kh, kw] (got {d['merge_kernel_size']!r})"
            )
        kw = {k: v for k, v in d.items() if k in names}
        extras = {k: v for k, v in d.items() if k not in names and k not in _FIXED}
        return cls(**kw, extras=extras)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `vision_config` dict: the extras read, the fixed keys, then every field."""
        out: dict[str, Any] = dict(self.extras)
        out.update(_FIXED)
        for f in dataclasses.fields(self):
            if f.name != "extras":
                out[f.name] = getattr(self, f.name)
        out["merge_kernel_size"] = list(self.merge_kernel_size)
        return out


def _pair(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v


_TYPE_CHECKS = {
    "int": _is_int,
    "str": lambda v: isinstance(v, str),
    "float": _is_number,
    "tuple[int, int]": lambda v: isinstance(v, tuple) and len(v) == 2,
    "dict[str, Any]": lambda v: isinstance(v, dict),
}
