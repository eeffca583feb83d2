"""Speculative decoding for the engine: DSpark block drafts, lossless verification, ReplaySSM for KDA state.

config.py    SpecConfig: what `EngineConfig.speculation` takes (drafter, block size, planner)
strategy.py  SpecDecode: the decode strategy (draft, verify gamma + 1 in one forward, keep a prefix, fold)
verify.py    lossless verification (min(1, p'/q) acceptance, residual draws; greedy argmax agreement)
replay.py    the verify forward that never writes KDA state, and the fold over the accepted tokens
snapshot.py  the snapshot baseline ReplaySSM replaces (a state snapshot per draft step), to measure against
graphs.py    the verify forward of verify_all replayed from CUDA graphs by batch bucket
fold_graphs.py  the fold replayed from CUDA graphs by batch bucket (every row, masked to its tokens)
drafter.py   the Drafter seam and the DSpark block drafter
planner.py   the cost-aware verify planner (lagged-confidence budget on a measured cost surface)
"""

from rollout.spec.config import SpecConfig
from rollout.spec.drafter import Drafter

__all__ = ["SpecConfig", "Drafter"]
