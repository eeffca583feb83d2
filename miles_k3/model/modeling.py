"""K3ForCausalLM: the single-device reference model built from the shared ops.

`K3ForCausalLM(config)` builds with plain torch linears; pass `linear=` and
`experts=` factories to build the same math on other weights (megatron
parallel linears, MXFP4 + LoRA), and `tp=` for a tensor-parallel rank's share
(see `miles_k3.model.linear.TensorParallel`), `cp=` for a context-parallel one (see
`miles_k3.model.context`). `from_pretrained` / `save_pretrained` read and
write the HF layout (see `miles_k3.model.checkpoint`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.cache import K3StateCache
from miles_k3.model.config import K3Config
from miles_k3.model.context import NO_CP, ContextParallel
from miles_k3.model.layers import K3DecoderLayer
from miles_k3.model.linear import (SINGLE, ExpertsFactory, LinearFactory, LinearSpec, TensorParallel, torch_experts,
                                   torch_linear)
from miles_k3.model.norm import RMSNorm
from miles_k3.ops.attnres import attn_res_mix


class K3Output(NamedTuple):
    logits: torch.Tensor  # [B, T, V]
    hidden_states: torch.Tensor  # [B, T, D], after the final norm


class K3Model(nn.Module):
    """Embedding, decoder layers, final AttnRes mix and norm. Names match HF's `model.*`."""

    def __init__(self, config: K3Config, linear: LinearFactory, experts: ExpertsFactory,
                 tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP):
        super().__init__()
        c = self.config = config
        self.tp, self.cp = tp, cp
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(c, i, linear, experts, tp, cp) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(c.hidden_size, c.res_eps)
            self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, cache: K3StateCache | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, D]. With `cu_seqlens` ([N+1], B == 1) the
        row holds N packed sequences that do not see each other; with `cache`, T new tokens continue it."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("cu_seqlens (packed sequences) cannot be combined with a decode cache")
            if input_ids.shape[0] != 1 or int(cu_seqlens[-1]) != input_ids.shape[1] or int(cu_seqlens[0]) != 0:
                raise ValueError("cu_seqlens must start at 0 and end at T, with input_ids of shape [1, T]")
        if self.tp.sequence_parallel:
            if cache is not None:
                raise ValueError("sequence parallelism shards whole sequences: it takes no decode cache")
            return self._sequence_parallel_hidden(input_ids, cu_seqlens)
        h = self.hidden(input_ids, cache, cu_seqlens)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return h

    def hidden(self, input_ids: torch.Tensor, cache: K3StateCache | None,
               cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """The computation of `forward` without its argument checks and without advancing the cache: for a
        caller whose cache tracks positions itself (the engine's paged cache, which also takes packed
        sequences)."""
        h = self.tp.seq_scatter(self.embed_tokens(input_ids))
        blocks: list[torch.Tensor] = []
        for layer in self.layers:
            h, blocks = layer(h, blocks, cache, cu_seqlens)
        if self.config.attn_res_block_size:
            h = attn_res_mix(h, blocks, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight,
                             self.config.res_eps)
        return self.tp.seq_gather(self.norm(h))

    def _sequence_parallel_hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """`hidden` with T padded up to a multiple of the TP size by token 0 at the end, then cut back: every
        mixer is causal, so the padding changes no real token's output (packed rows get the padding as a
        sequence of its own)."""
        t = input_ids.shape[1]
        pad = -t % self.tp.size
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            if cu_seqlens is not None:
                cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([t + pad])])
        return self.hidden(input_ids, None, cu_seqlens)[:, :t]


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config, linear: LinearFactory = torch_linear,
                 experts: ExpertsFactory = torch_experts, tp: TensorParallel = SINGLE,
                 cp: ContextParallel = NO_CP):
        super().__init__()
        self.config = config
        self.model = K3Model(config, linear, experts, tp, cp)
        if not config.tie_word_embeddings:
            self.lm_head = linear(LinearSpec("lm_head", config.hidden_size, config.vocab_size, "column"))
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Pretraining init: normal(0, std) projections and embeddings, unit norms, zero AttnRes queries
        (uniform mixing at start), KDA decay A = U(1, 16) and dt_bias = inverse softplus of U(1e-3, 0.1),
        as fla and Kimi-Linear initialize them. Uses the global torch RNG."""
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
                p.view(-1)[self.config.kda_num_heads:] = 0.0  # K3's layout pads the heads with zeros
            elif leaf == "dt_bias":
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "_res_proj" in name:
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            elif "conv1d" in name:
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
            else:
                p.normal_(0.0, std)
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return hidden @ self.model.embed_tokens.weight.t()
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, cache: K3StateCache | None = None,
                cu_seqlens: torch.Tensor | None = None) -> K3Output:
        hidden = self.model(input_ids, cache, cu_seqlens)
        return K3Output(self.logits(hidden), hidden)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "K3ForCausalLM":
        from miles_k3.model.checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 4 << 30) -> None:
        from miles_k3.model.checkpoint import save_pretrained

        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)


def reference_state(config: K3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference model's pretraining init (fp32, CPU) for a seed, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return K3ForCausalLM(config).state_dict()
