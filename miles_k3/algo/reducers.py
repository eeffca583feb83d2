"""Loss reducers: per-token values [B, T] -> one scalar, over the response tokens.

Notation: x[b, t] a per-token value, m[b, t] the loss mask (1 on response
tokens that carry loss), L_b = sum_t m[b, t] the response length of row b.

    token_mean     sum_{b,t} m x / sum_{b,t} m                 (DAPO: every token weighs the same)
    sequence_mean  mean_{b: L_b > 0} ( sum_t m x / L_b )       (GRPO paper: every sequence weighs the same)
    dr_grpo        sum_{b,t} m x / (B * L_max)                 (Dr.GRPO, arXiv 2503.20783: a constant
                                                                 divisor, so no length bias either way)

L_max is a constant the caller fixes (the configured generation limit), not
the batch's longest row: a batch-dependent divisor would bring back the length
coupling Dr.GRPO removes.

Denominators default to this batch. Under gradient accumulation the trainer
passes the global ones (`num_tokens`, `num_sequences`) so that the sum of the
micro-batch losses equals the loss of the whole batch.

Masked positions are *selected out* (torch.where), never multiplied by 0, so
a NaN or inf in padding cannot leak into the value or the gradient.
"""

from __future__ import annotations

import torch

__all__ = [
    "REDUCERS",
    "as_bool_mask",
    "masked_sum",
    "masked_mean",
    "token_mean",
    "sequence_mean",
    "dr_grpo_mean",
    "reduce_loss",
]

REDUCERS = ("token_mean", "sequence_mean", "dr_grpo")


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Loss mask as bool: accepts bool, or 0/1 ints/floats (nonzero = valid)."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """sum(x over mask); masked entries contribute exactly 0 (even if NaN/inf)."""
    x = torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """sum(x over mask) / max(count(mask), 1): an empty mask gives 0, not NaN."""
    count = as_bool_mask(mask).sum() if dim is None else as_bool_mask(mask).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


def token_mean(x: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """sum_{b,t} m x / N_tok, N_tok = sum m (or the given global `num_tokens`). x, mask [B, T] -> []."""
    if num_tokens is None:
        return masked_mean(x, mask)
    return masked_sum(x, mask) / num_tokens


def sequence_mean(
    x: torch.Tensor, mask: torch.Tensor, *, num_sequences: float | torch.Tensor | None = None
) -> torch.Tensor:
    """mean over rows with L_b > 0 of (sum_t m x / L_b). x, mask [B, T] -> [].

    Rows with no valid token (fully masked) are not sequences: they add 0 and
    are not counted, unless the caller fixes `num_sequences`.
    """
    valid = as_bool_mask(mask)
    lengths = valid.sum(-1)
    per_seq = masked_sum(x, valid, -1) / lengths.clamp_min(1).to(x.dtype)
    if num_sequences is None:
        num_sequences = (lengths > 0).sum().clamp_min(1).to(x.dtype)
    return per_seq.sum() / num_sequences


def dr_grpo_mean(
    x: torch.Tensor, mask: torch.Tensor, max_response_len: int, *, num_sequences: float | torch.Tensor | None = None
) -> torch.Tensor:
    """sum_{b,t} m x / (B * L_max), B = rows (or `num_sequences`), L_max a constant. x, mask [B, T] -> []."""
    if max_response_len <= 0:
        raise ValueError(f"max_response_len must be > 0, got {max_response_len}")
    rows = x.shape[0] if num_sequences is None else num_sequences
    return masked_sum(x, mask) / (rows * max_response_len)


def reduce_loss(
    x: torch.Tensor,
    mask: torch.Tensor,
    reducer: str,
    *,
    max_response_len: int | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch on `reducer` in REDUCERS. x, mask [B, T] -> [] in x's dtype.

    `max_response_len` is required by (and only read by) "dr_grpo";
    `num_tokens` is read by "token_mean", `num_sequences` by the other two.
    """
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"x and mask must both be [B, T]; got {tuple(x.shape)} and {tuple(mask.shape)}")
    if reducer == "token_mean":
        return token_mean(x, mask, num_tokens=num_tokens)
    if reducer == "sequence_mean":
        return sequence_mean(x, mask, num_sequences=num_sequences)
    if reducer == "dr_grpo":
        if max_response_len is None:
            raise ValueError("reducer 'dr_grpo' needs max_response_len (the constant divisor)")
        return dr_grpo_mean(x, mask, max_response_len, num_sequences=num_sequences)
    raise ValueError(f"unknown reducer {reducer!r}; expected one of {REDUCERS}")
