"""K3ForCausalLM: the single-device reference model built from the shared ops.

`K3ForCausalLM(config)` builds with plain torch linears; pass `linear=` and
`experts=` factories to build the same math on other weights (megatron
parallel linears, MXFP4 + LoRA), and `tp=` for a tensor-parallel rank's share
(see `miles_k3.model.linear.TensorParallel`), `cp=` for a context-parallel one (see
`miles_k3.model.context`). `from_pretrained` / `save_pretrained` read and
write the HF layout (see `miles_k3.model.checkpoint`).

Pipeline stages: `layers=range(a, b)` builds only those decoder layers (their names keep the global index,
`model.layers.{i}.*`, so checkpoints and adapters are named as in the whole model), the embedding on the
stage holding layer 0 (and on the last stage too when embeddings are tied: it is the logits' weight), the
final AttnRes mix, norm and lm_head on the stage holding the last layer. A stage that does not start at
layer 0 takes the previous stage's output as `inputs=`; one that does not end at the last layer returns its
residual state packed into one tensor (`pack_residual`), the tensor a pipeline send carries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from miles_k3.model.cache import K3StateCache
from miles_k3.model.config import K3Config
from miles_k3.model.context import NO_CP, ContextParallel
from miles_k3.model.layers import K3DecoderLayer
from miles_k3.model.linear import (
    SINGLE,
    ExpertsFactory,
    LinearFactory,
    LinearSpec,
    TensorParallel,
    torch_experts,
    torch_linear,
)
from miles_k3.model.norm import RMSNorm
from miles_k3.ops.attnres import attn_res_mix_rms_norm


def bank_rows(config: K3Config, layer_idx: int) -> int:
    """How many finished AttnRes block sums the residual state holds on entering layer `layer_idx` (or, with
    `layer_idx` = the layer count, after the last layer): a block closes at every layer whose index divides
    by the block size (the embedding output is the first). 0 without AttnRes."""
    size = config.attn_res_block_size
    return -(-layer_idx // size) if size else 0


def pack_residual(h: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
    """The residual state (h [.., D], blocks: n x [.., D]) as one tensor [.., (1 + n) * D]: the running
    partial sum first, then the finished block sums in order. Without AttnRes (no blocks) it is `h` itself."""
    return torch.cat([h, *blocks], dim=-1) if blocks else h


def unpack_residual(x: torch.Tensor, config: K3Config, layer_idx: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Inverse of `pack_residual` for the state entering layer `layer_idx` (views of x, so gradients flow
    back into it). The bank's row count comes from the layer index and block size; a tensor of another
    width is a ValueError naming both widths."""
    d, n = config.hidden_size, bank_rows(config, layer_idx)
    if x.shape[-1] != (1 + n) * d:
        raise ValueError(
            f"pipeline input for layer {layer_idx}: width {x.shape[-1]}, expected {(1 + n) * d} "
            f"= (1 prefix sum + {n} AttnRes blocks) x hidden_size {d}"
        )
    h, *blocks = x.split(d, dim=-1)
    return h, blocks


class LayerStack(nn.Module):
    """A stage's decoder layers under their global indices (`layers.{i}`), iterated and indexed in order
    (`stack[0]` is the stage's first layer)."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for i, layer in layers.items():
            self.add_module(str(i), layer)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, k: int) -> nn.Module:
        return list(self._modules.values())[k]


class Embedding(nn.Embedding):
    """The token embedding; `tied_logits` is the tied head (logits = h E^T). A parallel build's embedding
    factory returns a module with the same contract (`megatron_patches.vocab_parallel`)."""

    def tied_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.t()


class MediaEmbeds(NamedTuple):
    """Media features that take the place of the token embeddings at the media pad positions.

    `positions` [M] (int64) index the flattened [B * T] token grid of the forward's `input_ids` (for one
    packed row, positions in that row); `features` [M, D] are the projected vision features in prompt
    order, one row per `<|media_pad|>` token. Only the stage holding the embedding reads them."""

    positions: torch.Tensor
    features: torch.Tensor

    def splice(self, embeds: torch.Tensor) -> torch.Tensor:
        """embeds [B, T, D] with the media rows replaced (a new tensor: autograd reaches the features)."""
        d = embeds.shape[-1]
        if self.features.dim() != 2 or self.features.shape != (self.positions.numel(), d):
            raise ValueError(
                f"media features must be [{self.positions.numel()}, {d}] (one row per media pad "
                f"position), got {tuple(self.features.shape)}"
            )
        flat = embeds.reshape(-1, d).index_copy(0, self.positions, self.features.to(embeds.dtype))
        return flat.view_as(embeds)


class K3Output(NamedTuple):
    logits: torch.Tensor  # [B, T, V]
    hidden_states: torch.Tensor  # [B, T, D], after the final norm


def _check_layers(config: K3Config, layers: range | None) -> range:
    n = config.num_hidden_layers
    if layers is None:
        return range(n)
    if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start < layers.stop <= n:
        raise ValueError(f"layers must be a non-empty range(start, stop) inside range(0, {n}), got {layers!r}")
    return layers


class K3Model(nn.Module):
    """Embedding, decoder layers, final AttnRes mix and norm. Names match HF's `model.*`.

    `layers` (default: all) is the range of decoder layers this build holds (a pipeline stage, see the
    module docstring); `first` / `last` say whether it holds layer 0 / the last layer."""

    def __init__(
        self,
        config: K3Config,
        linear: LinearFactory,
        experts: ExpertsFactory,
        tp: TensorParallel = SINGLE,
        cp: ContextParallel = NO_CP,
        layers: range | None = None,
        embedding: Callable[[int, int], nn.Module] = Embedding,
    ):
        super().__init__()
        c = self.config = config
        self.tp, self.cp = tp, cp
        self.layer_range = _check_layers(c, layers)
        self.first = self.layer_range.start == 0
        self.last = self.layer_range.stop == c.num_hidden_layers
        if self.first or (self.last and c.tie_word_embeddings):
            self.embed_tokens = embedding(c.vocab_size, c.hidden_size)
        self.layers = LayerStack({i: K3DecoderLayer(c, i, linear, experts, tp, cp) for i in self.layer_range})
        if self.last:
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            if c.attn_res_block_size:
                self.output_attn_res_norm = RMSNorm(c.hidden_size, c.res_eps)
                self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)

    @property
    def whole(self) -> bool:
        return self.first and self.last

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: K3StateCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        inputs: torch.Tensor | None = None,
        media: MediaEmbeds | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, D]. With `cu_seqlens` ([N+1], B == 1) the
        row holds N packed sequences that do not see each other; with `cache`, T new tokens continue it.
        `media` replaces the embeddings at the media pad positions with image features (first stage only).

        A pipeline stage takes the same input_ids and cu_seqlens (every stage sees the micro-batch) and,
        unless it is the first, the previous stage's packed output as `inputs`; unless it is the last, it
        returns its packed residual state [B, T', (1 + n_blocks) * D] (T' = this rank's sequence slice under
        sequence parallelism, of T padded to a multiple of the TP size)."""
        if (inputs is None) != self.first:
            raise ValueError(
                f"layers {self.layer_range.start}..{self.layer_range.stop - 1}: inputs (the previous "
                f"stage's output) must be given exactly when the stage does not start at layer 0"
            )
        if cache is not None and not self.whole:
            raise ValueError("a pipeline stage takes no decode cache (the engine runs the whole model)")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if media is not None and not self.first:
            raise ValueError("media features enter with the embedding: only the stage holding layer 0 takes them")
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("cu_seqlens (packed sequences) cannot be combined with a decode cache")
            if input_ids.shape[0] != 1 or int(cu_seqlens[-1]) != input_ids.shape[1] or int(cu_seqlens[0]) != 0:
                raise ValueError("cu_seqlens must start at 0 and end at T, with input_ids of shape [1, T]")
        if self.tp.sequence_parallel:
            if cache is not None:
                raise ValueError("sequence parallelism shards whole sequences: it takes no decode cache")
            return self._sequence_parallel_hidden(input_ids, cu_seqlens, inputs, media)
        h = self.hidden(input_ids, cache, cu_seqlens, inputs, media)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return h

    def hidden(
        self,
        input_ids: torch.Tensor,
        cache: K3StateCache | None,
        cu_seqlens: torch.Tensor | None,
        inputs: torch.Tensor | None = None,
        media: MediaEmbeds | None = None,
    ) -> torch.Tensor:
        """The computation of `forward` without its argument checks and without advancing the cache: for a
        caller whose cache tracks positions itself (the engine's paged cache, which also takes packed
        sequences)."""
        if self.first:
            x = self.embed_tokens(input_ids)
            h, blocks = self.tp.seq_scatter(x if media is None else media.splice(x)), []
        else:
            h, blocks = unpack_residual(inputs, self.config, self.layer_range.start)
        for layer in self.layers:
            h, blocks = layer(h, blocks, cache, cu_seqlens)
        if not self.last:
            return pack_residual(h, blocks)
        if self.config.attn_res_block_size:  # the mix and the final norm, one op (nothing else reads the mix)
            return self.tp.seq_gather(
                attn_res_mix_rms_norm(
                    h,
                    blocks,
                    self.output_attn_res_norm.weight,
                    self.output_attn_res_proj.weight,
                    self.config.res_eps,
                    self.norm.weight,
                    self.norm.eps,
                )
            )
        return self.tp.seq_gather(self.norm(h))

    def _sequence_parallel_hidden(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        inputs: torch.Tensor | None,
        media: MediaEmbeds | None,
    ) -> torch.Tensor:
        """`hidden` with T padded up to a multiple of the TP size by token 0 at the end, then cut back: every
        mixer is causal, so the padding changes no real token's output (packed rows get the padding as a
        sequence of its own). A stage before the last returns its packed state of the padded sequence."""
        t = input_ids.shape[1]
        pad = -t % self.tp.size
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            if cu_seqlens is not None:
                cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([t + pad])])
        if media is not None and pad and input_ids.shape[0] > 1:  # positions index [B, T]: re-index to [B, T + pad]
            media = MediaEmbeds(media.positions + media.positions // t * pad, media.features)
        out = self.hidden(input_ids, None, cu_seqlens, inputs, media)
        return out[:, :t] if self.last else out


class K3ForCausalLM(nn.Module):
    """The causal LM: `K3Model` and the logits (lm_head, or the embedding when tied). `layers` builds a
    pipeline stage (see the module docstring): only the last stage has logits."""

    def __init__(
        self,
        config: K3Config,
        linear: LinearFactory = torch_linear,
        experts: ExpertsFactory = torch_experts,
        tp: TensorParallel = SINGLE,
        cp: ContextParallel = NO_CP,
        layers: range | None = None,
        embedding: Callable[[int, int], nn.Module] = Embedding,
    ):
        super().__init__()
        self.config = config
        self.model = K3Model(config, linear, experts, tp, cp, layers, embedding)
        if self.model.last and not config.tie_word_embeddings:
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
                p.view(-1)[self.config.kda_num_heads :] = 0.0  # K3's layout pads the heads with zeros
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
            return self.model.embed_tokens.tied_logits(hidden)
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: K3StateCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        media: MediaEmbeds | None = None,
    ) -> K3Output:
        if not self.model.whole:
            raise ValueError(
                "a pipeline stage has no whole-model forward: call .model(input_ids, inputs=...) "
                "and, on the last stage, .logits(hidden)"
            )
        hidden = self.model(input_ids, cache, cu_seqlens, media=media)
        return K3Output(self.logits(hidden), hidden)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> "K3ForCausalLM":
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
