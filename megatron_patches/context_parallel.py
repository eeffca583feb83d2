"""Context parallelism for the trainer: the zigzag sequence split over megatron's CP group and the
`ContextParallel` share the sequence mixers consult (see `miles_k3.model.context`).

Being built (issue 13 part 2): until then a CP size above 1 is refused by name.
"""

from __future__ import annotations

from megatron.core import parallel_state as ps

from miles_k3.model.context import NO_CP, ContextParallel


def context_share() -> ContextParallel:
    """This rank's CP share from megatron's parallel state (the base class when CP is 1)."""
    if ps.get_context_parallel_world_size() == 1:
        return NO_CP
    raise ValueError("parallel.cp > 1 is not built yet")
