"""K3 decoder layers: KDA and NoPE-MLA mixers, the decoder layer with Attention Residuals.

Every projection comes from a `LinearFactory` and every carried state goes
through a `K3StateCache`; the math is the ops in `miles_k3.ops`. Attribute
names equal the HF checkpoint names, so `state_dict()` keys are the layout's.
"""

from __future__ import annotations

import torch
from torch import nn

from miles_k3.model.cache import K3StateCache, KDAState
from miles_k3.model.config import K3Config
from miles_k3.model.context import NO_CP, ContextParallel
from miles_k3.model.layout import kda_a_log_shape
from miles_k3.model.linear import SINGLE, ExpertsFactory, LinearFactory, LinearSpec, TensorParallel
from miles_k3.model.moe import GLUMLP, LatentMoE
from miles_k3.model.norm import RMSNorm
from miles_k3.ops.attnres import add_attn_res_mix_rms_norm, attn_res_mix_rms_norm
from miles_k3.ops.kda import kda_gate_beta
from miles_k3.ops.mla import mla_attention, packed_causal_attention
from miles_k3.ops.norm import gated_rms_norm


def _conv_holder(channels: int, kernel: int) -> nn.Conv1d:
    # Holds the HF-layout weight [C, 1, W]; the math is `causal_short_conv`, never Conv1d.forward.
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)


def _local_a_log_shape(c: K3Config, heads: int, tp: TensorParallel) -> tuple[int, ...]:
    if tp.size == 1:
        return kda_a_log_shape(c)
    # A tensor-parallel rank holds only its heads' rates, unpadded (padding is a checkpoint detail).
    return (heads,)


class KDAMixer(nn.Module):
    """Kimi Delta Attention. x [B, T, D] -> [B, T, D].

    Under tensor parallelism (`tp.size` > 1) this rank runs `kda_num_heads / tp.size` heads: the column
    projections give it those heads' channels, conv weights / dt_bias / A_log hold those heads only, and
    the row-parallel o_proj sums the ranks' outputs."""

    def __init__(
        self,
        config: K3Config,
        layer_idx: int,
        name: str,
        linear: LinearFactory,
        tp: TensorParallel = SINGLE,
        cp: ContextParallel = NO_CP,
    ):
        super().__init__()
        c = self.config = config
        self.layer_idx = layer_idx
        self.cp = cp
        self.heads = tp.split(c.kda_num_heads, "kda_num_heads")
        d, hk, r = c.hidden_size, c.kda_dim, c.gate_rank
        local_hk = self.heads * c.kda_head_dim
        for p in "qkv":
            setattr(self, f"{p}_proj", linear(LinearSpec(f"{name}.{p}_proj", d, hk, "column")))
            setattr(self, f"{p}_conv1d", _conv_holder(local_hk, c.kda_conv_kernel))
        self.f_a_proj = linear(LinearSpec(f"{name}.f_a_proj", d, r, "replicated"))
        self.f_b_proj = linear(LinearSpec(f"{name}.f_b_proj", r, hk, "column"))
        self.A_log = nn.Parameter(torch.zeros(_local_a_log_shape(c, self.heads, tp)))
        self.dt_bias = nn.Parameter(torch.zeros(local_hk))
        self.b_proj = linear(LinearSpec(f"{name}.b_proj", d, c.kda_num_heads, "column"))
        if c.kda_output_gate == "full":
            self.g_proj = linear(LinearSpec(f"{name}.g_proj", d, hk, "column"))
        else:
            self.g_a_proj = linear(LinearSpec(f"{name}.g_a_proj", d, r, "replicated"))
            self.g_b_proj = linear(LinearSpec(f"{name}.g_b_proj", r, hk, "column"))
        self.o_norm = RMSNorm(c.kda_head_dim, c.rms_norm_eps)
        self.o_proj = linear(LinearSpec(f"{name}.o_proj", hk, d, "row"))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.kda_output_gate == "full":
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(
        self, x: torch.Tensor, cache: K3StateCache | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Under context parallelism (`cp.size` > 1) the mixer runs on this rank's contiguous segment of the
        row: `cp.to_segment` moves the zigzag-ordered input there, the conv and recurrence take what earlier
        segments leave (`cp.short_conv`, `cp.kda`), and `cp.to_zigzag` moves the output back."""
        c, cp = self.config, self.cp
        x = cp.to_segment(x)
        b, t, _ = x.shape
        heads = (b, t, self.heads, c.kda_head_dim)
        prev = cache.kda_state(self.layer_idx) if cache is not None else None
        convs = cp.short_convs(
            [getattr(self, f"{p}_proj")(x) for p in "qkv"],
            [getattr(self, f"{p}_conv1d").weight for p in "qkv"],
            states=list(prev[:3]) if prev is not None else [None] * 3,
            cu_seqlens=cu_seqlens,
        )
        qkv = [y.view(heads) for y, _ in convs]
        conv = [new_state for _, new_state in convs]
        g, beta = kda_gate_beta(
            self.f_b_proj(self.f_a_proj(x)),
            self.b_proj(x),
            self.A_log,
            self.dt_bias,
            num_heads=self.heads,
            form=c.kda_gate_form,
            lower_bound=c.kda_gate_lower_bound,
        )
        o, recurrent = cp.kda(
            *qkv,
            g,
            beta,
            initial_state=prev.recurrent if prev is not None else None,
            output_final_state=cache is not None,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm=True,
        )
        if cache is not None:
            cache.set_kda_state(self.layer_idx, KDAState(*conv, recurrent))
        o = gated_rms_norm(o, self.output_gate(x).view(heads), self.o_norm.weight, c.rms_norm_eps)
        return self.o_proj(cp.to_zigzag(o.reshape(b, t, self.heads * c.kda_head_dim)))


class MLAMixer(nn.Module):
    """Multi-head latent attention without rotary embedding, with K3's optional output gate.

    Under tensor parallelism this rank runs `mla_num_heads / tp.size` heads (column-split q / kv_b / g
    projections); the latent projections are replicated and o_proj reduces across ranks."""

    def __init__(
        self,
        config: K3Config,
        layer_idx: int,
        name: str,
        linear: LinearFactory,
        tp: TensorParallel = SINGLE,
        cp: ContextParallel = NO_CP,
    ):
        super().__init__()
        c = self.config = config
        self.layer_idx = layer_idx
        self.heads = tp.split(c.mla_num_heads, "mla_num_heads")
        self.tp, self.cp = tp, cp
        d, h = c.hidden_size, c.mla_num_heads
        if c.q_lora_rank is None:
            self.q_proj = linear(LinearSpec(f"{name}.q_proj", d, h * c.qk_head_dim, "column"))
        else:
            self.q_a_proj = linear(LinearSpec(f"{name}.q_a_proj", d, c.q_lora_rank, "replicated"))
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.mla_latent_norm_eps)
            self.q_b_proj = linear(LinearSpec(f"{name}.q_b_proj", c.q_lora_rank, h * c.qk_head_dim, "column"))
        self.kv_a_proj_with_mqa = linear(
            LinearSpec(f"{name}.kv_a_proj_with_mqa", d, c.kv_lora_rank + c.qk_rope_head_dim, "replicated")
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.mla_latent_norm_eps)
        self.kv_b_proj = linear(
            LinearSpec(f"{name}.kv_b_proj", c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), "column")
        )
        self.o_proj = linear(LinearSpec(f"{name}.o_proj", h * c.v_head_dim, d, "row"))
        if c.mla_output_gate:
            self.g_proj = linear(LinearSpec(f"{name}.g_proj", d, h * c.v_head_dim, "column"))
        self.scale = c.qk_head_dim**-0.5

    def forward(
        self, x: torch.Tensor, cache: K3StateCache | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # this rank's heads; an engine under decode context parallelism projects its DCP group's (rollout.dcp)
        q = q.view(b, t, -1, c.qk_head_dim)
        latent, rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        # the cache may attend over its history in its own form (the engine: absorbed, over paged KV)
        o = cache.mla_attention(self, q, latent, rope) if cache is not None else None
        if o is None:
            o = self.expanded_attention(q, latent, rope, cache, cu_seqlens)
        o = o.reshape(b, t, self.heads * c.v_head_dim)
        if c.mla_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def expanded_attention(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        rope: torch.Tensor,
        cache: K3StateCache | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The reference attention: q [B, T, H, Dqk] over the history (this step's latent [B, T, R] and
        shared key part [B, T, Dr], after the cache's past ones), expanded through kv_b_proj into per-head
        keys and values -> [B, T, H, Dv]."""
        c = self.config
        b, h = q.shape[0], self.heads
        mask = None
        if cache is not None:
            latent, rope, mask = cache.mla_extend(self.layer_idx, latent, rope)
        # context parallel: every rank's latent KV in sequence order (expanded here) and the mask over it
        latent, rope, mask = self.cp.mla_keys(latent, rope, mask)
        s = latent.shape[1]
        k_nope, v = self.kv_b_proj(latent).view(b, s, h, -1).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        rope = self.tp.enter(rope)  # shared by all heads, this rank's included
        k = torch.cat([k_nope, rope[:, :, None, :].expand(b, s, h, c.qk_rope_head_dim)], dim=-1)
        if cu_seqlens is not None and cache is None and self.cp.size == 1:
            return packed_causal_attention(q, k, v, self.scale, cu_seqlens)
        return mla_attention(q, k, v, self.scale, mask)


class K3DecoderLayer(nn.Module):
    """One decoder layer. Residual state is (h, blocks): `h` the running partial sum of the current AttnRes
    block, `blocks` the finished block sums (always empty without AttnRes, where h is the plain stream).
    Under sequence parallelism h and blocks hold this rank's slice of the sequence."""

    def __init__(
        self,
        config: K3Config,
        layer_idx: int,
        linear: LinearFactory,
        experts: ExpertsFactory,
        tp: TensorParallel = SINGLE,
        cp: ContextParallel = NO_CP,
    ):
        super().__init__()
        c = self.config = config
        self.layer_idx = layer_idx
        self.tp = tp
        name = f"model.layers.{layer_idx}"
        d = c.hidden_size
        if c.attn_res_block_size:
            self.self_attention_res_norm = RMSNorm(d, c.res_eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, c.res_eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        mixer = KDAMixer if c.layer_kinds[layer_idx] == "kda" else MLAMixer
        self.self_attn = mixer(c, layer_idx, f"{name}.self_attn", linear, tp, cp)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        if c.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(c, f"{name}.block_sparse_moe", linear, experts)
        else:
            self.mlp = GLUMLP(
                f"{name}.mlp", d, c.dense_intermediate_size, c.hidden_act, (c.situ_beta, c.situ_beta_lin), linear
            )

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def _mixed_norm(self, h: torch.Tensor, blocks: list[torch.Tensor], site: str, then: RMSNorm) -> torch.Tensor:
        """`then(attn_res_mix(...))`: the sublayer's norm of its mixed input, one op (one kernel under
        `use_kernels`), since nothing else reads the mix."""
        norm, proj = getattr(self, f"{site}_norm"), getattr(self, f"{site}_proj")
        return attn_res_mix_rms_norm(h, blocks, norm.weight, proj.weight, self.config.res_eps, then.weight, then.eps)

    def _added_mixed_norm(
        self, h: torch.Tensor, add: torch.Tensor, blocks: list[torch.Tensor], site: str, then: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + add, `_mixed_norm` of it): the residual add in the same op (one kernel under `use_kernels`)."""
        norm, proj = getattr(self, f"{site}_norm"), getattr(self, f"{site}_proj")
        return add_attn_res_mix_rms_norm(
            h, add, blocks, norm.weight, proj.weight, self.config.res_eps, then.weight, then.eps
        )

    def _sublayer(self, module: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
        # Sequence parallel: the mixer / MLP sees the whole sequence, the residual stream keeps its slice.
        return self.tp.seq_scatter(module(self.tp.seq_gather(x), *args))

    def forward(
        self,
        h: torch.Tensor,
        blocks: list[torch.Tensor],
        cache: K3StateCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        block_size = self.config.attn_res_block_size
        if not block_size:
            h = h + self._sublayer(self.self_attn, self.input_layernorm(h), cache, cu_seqlens)
            return h + self._sublayer(self.ffn, self.post_attention_layernorm(h)), blocks
        normed = (
            self._mixed_norm(h, blocks, "self_attention_res", self.input_layernorm)
            if blocks
            else self.input_layernorm(h)
        )
        attn_out = self._sublayer(self.self_attn, normed, cache, cu_seqlens)
        if self.layer_idx % block_size == 0:
            blocks, h = [*blocks, h], attn_out
            normed = self._mixed_norm(h, blocks, "mlp_res", self.post_attention_layernorm)
        else:
            h, normed = self._added_mixed_norm(h, attn_out, blocks, "mlp_res", self.post_attention_layernorm)
        return h + self._sublayer(self.ffn, normed), blocks
