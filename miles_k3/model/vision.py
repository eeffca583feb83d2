"""K3VisionModel: K3's vision tower (MoonViT3d) and projector (PatchMergerMLPV2), one definition for the
engine, the trainer and the reference.

    pixel_values [N, 3, p, p] --patch_embed (conv p x p = a linear over each patch) + position table
      --> encoder: blocks x (pre-RMSNorm attention with 2-D rotary, inside each image; pre-RMSNorm MLP)
      --> final_layernorm --> kh x kw merge (mean over time) --> mm_projector --> [tokens, text_hidden]

Attribute names are the checkpoint's (`vision_tower.*`, `mm_projector.*`, unprefixed by the wrapper), so
`state_dict()` is the checkpoint layout (`VisionConfig.tensor_shapes`). Patches come as the processor emits
them: row-major over each frame's (h, w) patch grid, frames in order, images concatenated; the published
tower reads them in that order too (its merge reshapes [t, h/kh, kh, w/kw, kw]), so nothing is reordered.
`encode` returns each image's merged tokens row-major over its merged grid: the order of its
`<|media_pad|>` tokens.

Norms: the blocks' and `final_layernorm` use the dtype's machine epsilon (the released tower builds
`nn.RMSNorm(dim)` without an eps), the projector's `projector_ln_eps`. Precision follows the text model: the
parameters' dtype throughout (fp32 reference on CPU, bf16 on GPU), rotary and norms in fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.linear import LinearFactory, LinearSpec, torch_linear
from miles_k3.model.vision_config import ROPE_MAX_GRID, VisionConfig
from miles_k3.ops.norm import rms_norm
from miles_k3.ops.vision import (
    Grid,
    apply_rope_2d,
    grid_bounds,
    merge_patches,
    position_embedding,
    rope_2d,
    varlen_attention,
)


class VisionRMSNorm(nn.Module):
    """RMSNorm holding `weight`; eps None = the input dtype's machine epsilon (as `nn.RMSNorm(dim)`)."""

    def __init__(self, dim: int, eps: float | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, torch.finfo(x.dtype).eps if self.eps is None else self.eps)


class PositionTable(nn.Module):
    """`pos_emb`: the learned [H0, W0, D] table; the sincos time term is computed, not stored."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.mode = c.pos_emb_interpolation_mode
        self.weight = nn.Parameter(torch.empty(c.init_pos_emb_height, c.init_pos_emb_width, c.vt_hidden_size))

    def forward(self, grids: list[Grid]) -> torch.Tensor:
        return position_embedding(self.weight, grids, self.mode)


class PatchEmbed(nn.Module):
    """`patch_embed`: each [3, p, p] patch through the conv `proj` (one output per patch: a linear), plus
    the position term."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, c.vt_hidden_size, kernel_size=c.patch_size, stride=c.patch_size, bias=False)
        self.pos_emb = PositionTable(c)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        x = F.linear(pixel_values.flatten(1), self.proj.weight.flatten(1))
        return x + self.pos_emb(grids)


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(c.vt_hidden_size, c.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(c.vt_intermediate_size, c.vt_hidden_size, bias=False)
        self.approximate = "tanh" if c.activation_func == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """x + wo(attention(rope(q), rope(k), v)) of norm0(x), then x + mlp(norm1(x)); `wqkv` is [q | k | v]."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = c.vt_num_attention_heads, c.head_dim
        self.norm0 = VisionRMSNorm(c.vt_hidden_size)
        self.norm1 = VisionRMSNorm(c.vt_hidden_size)
        self.wqkv = nn.Linear(c.vt_hidden_size, 3 * c.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(c.qkv_hidden_size, c.vt_hidden_size, bias=False)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, cis: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        q, k, v = self.wqkv(self.norm0(x)).reshape(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        x = x + self.wo(varlen_attention(apply_rope_2d(q, cis), apply_rope_2d(k, cis), v, bounds))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.vt_num_hidden_layers))
        self.final_layernorm = VisionRMSNorm(c.vt_hidden_size)

    def forward(self, x: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        cis = rope_2d(grids, self.blocks[0].head_dim, x.dtype, x.device)
        bounds = grid_bounds(grids)
        for block in self.blocks:
            x = block(x, cis, bounds)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    """`vision_tower`: patches -> merged patch features [tokens, kh * kw * D] (before the projector)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.merge_kernel_size = c.merge_kernel_size
        self.patch_embed = PatchEmbed(c)
        self.encoder = VisionEncoder(c)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        return merge_patches(self.encoder(self.patch_embed(pixel_values, grids), grids), grids, self.merge_kernel_size)


class Projector(nn.Module):
    """`mm_projector` (PatchMergerMLPV2): proj.0 (kh*kw*D -> kh*kw*D), GELU, proj.2 (-> text hidden), then
    post_norm; no biases. Its linears come from the factory, so a build may put LoRA on them."""

    def __init__(self, c: VisionConfig, linear: LinearFactory):
        super().__init__()
        m = c.projector_width
        self.proj = nn.Sequential(
            linear(LinearSpec("mm_projector.proj.0", m, m, "replicated")),
            nn.GELU(),
            linear(LinearSpec("mm_projector.proj.2", m, c.text_hidden_size, "replicated")),
        )
        self.post_norm = VisionRMSNorm(c.text_hidden_size, c.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))


class K3VisionModel(nn.Module):
    """The tower and projector. `encode(pixel_values, grid_thw)` -> the features of every image's
    `<|media_pad|>` tokens; `num_tokens(grid_thw)` -> how many each image has."""

    def __init__(self, config: VisionConfig, linear: LinearFactory = torch_linear):
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config)
        self.mm_projector = Projector(config, linear)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_tower.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.vision_tower.patch_embed.proj.weight.device

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """normal(0, std) linears, patch projection and position table; unit norms. Uses the global torch RNG."""
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)

    def num_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Merged tokens per image of grid_thw [n, 3] (t, h, w in patches): (h / kh) * (w / kw), whatever t."""
        kh, kw = self.config.merge_kernel_size
        return [(h // kh) * (w // kw) for _, h, w in self.check_grids(grid_thw)]

    def check_grids(self, grid_thw: torch.Tensor) -> list[Grid]:
        """grid_thw [n, 3] as a list of (t, h, w), or a one-line ValueError naming the image and the limit."""
        if (
            not isinstance(grid_thw, torch.Tensor)
            or grid_thw.dim() != 2
            or grid_thw.shape[1] != 3
            or grid_thw.is_floating_point()
        ):
            got = tuple(grid_thw.shape) if isinstance(grid_thw, torch.Tensor) else type(grid_thw).__name__
            raise ValueError(f"grid_thw must be an integer tensor [n_images, 3] of (t, h, w) patches, got {got}")
        c, (kh, kw) = self.config, self.config.merge_kernel_size
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        for i, (t, h, w) in enumerate(grids):
            if not 1 <= t <= c.init_pos_emb_time:
                raise ValueError(
                    f"grid_thw[{i}]: t={t} frames, the tower takes 1..{c.init_pos_emb_time} "
                    f"(vision_config.init_pos_emb_time)"
                )
            if h < 1 or w < 1 or h % kh or w % kw:
                raise ValueError(
                    f"grid_thw[{i}]: {h} x {w} patches must be positive multiples of the merge "
                    f"kernel {kh} x {kw} (vision_config.merge_kernel_size)"
                )
            if h > ROPE_MAX_GRID or w > ROPE_MAX_GRID:
                raise ValueError(
                    f"grid_thw[{i}]: {h} x {w} patches exceed the {ROPE_MAX_GRID} x {ROPE_MAX_GRID} "
                    "grid of the tower's rotary table"
                )
        return grids

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, p, p] (every image's patches, row-major per frame, images in order) and
        grid_thw [n_images, 3] -> features [sum num_tokens, text_hidden_size] in the model's dtype: image
        after image, each image's tokens row-major over its merged grid."""
        grids = self.check_grids(grid_thw)
        p = self.config.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [N, 3, {p}, {p}] patches, got {tuple(pixel_values.shape)}")
        n = grid_bounds(grids)[-1]
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw says {n} (sum t * h * w)")
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        return self.mm_projector(self.vision_tower(x, grids))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.encode(pixel_values, grid_thw)

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> "K3VisionModel":
        """The tower and projector of the K3 checkpoint at `path` (the text model's directory), validated
        against its config before anything is read (ValueError naming the tensor)."""
        from miles_k3.model.checkpoint import load_vision_pretrained

        return load_vision_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path, text: nn.Module, max_shard_bytes: int = 4 << 30) -> None:
        """Write the VL checkpoint: `text` (a `K3ForCausalLM` whose config holds this vision config) and
        these weights in one atomic save, one set of shards and index, as K3 ships them."""
        from miles_k3.model.checkpoint import save_pretrained

        save_pretrained(text, path, max_shard_bytes=max_shard_bytes, vision=self)
