"""The seam for context parallelism: this rank's share of a sequence split over a CP group.

A context-parallel build (`megatron_patches.context_parallel`) splits every packed row over `size` ranks
in megatron's load-balanced zigzag order and passes a `ContextParallel` subclass into the model, like the
`TensorParallel` share of `miles_k3.model.linear`. Linears, adapters, norms, AttnRes and the MoE are per
token and never consult it; only the sequence mixers do (KDA's relayout, short-conv halo and state
hand-off; MLA's attention over every rank's keys). The base class is the single-device case: one rank,
the whole sequence, and the mixers run exactly as without it.
"""

from __future__ import annotations


class ContextParallel:
    """`size` ranks share each sequence; this one is `rank`. The base class (size 1) is no split."""

    def __init__(self, size: int = 1, rank: int = 0):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"ContextParallel: need size >= 1 and 0 <= rank < size, got size={size}, rank={rank}")
        self.size, self.rank = size, rank


NO_CP = ContextParallel()
