"""Shared by the engine tests: a seeded k3-tiny reference, small engine settings, prompts, cold runs."""

from __future__ import annotations

import torch

from miles_k3.model import K3Config, K3ForCausalLM
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import Completion, SamplingParams

torch.manual_seed(0)
MODEL = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
# pages of 4 tokens and chunks of 8, so short prompts cross page and chunk boundaries
SMALL = dict(page_size=4, chunk_size=8, max_prefill_tokens=16, max_seq_len=256)
ROOMY = 8 << 20
TIGHT = dict(memory=360_000, state_fraction=0.95)  # 4 state slots, 11 pages of 4 tokens
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


def engine(memory: int = ROOMY, model: K3ForCausalLM = MODEL, adapters=None, **kw) -> Engine:
    return Engine(model, EngineConfig(memory_bytes=memory, **{**SMALL, **kw}), adapters)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cold(p: list[int], params: SamplingParams) -> Completion:
    """The request alone on a fresh engine: what any schedule, cache hit or retraction must reproduce."""
    return engine().generate([p], params)[0]


def drain(eng: Engine) -> dict[int, Completion]:
    """Step until idle; completions by request id."""
    done: dict[int, Completion] = {}
    while eng.has_work():
        done.update((c.request_id, c) for c in eng.step())
    return done


def assert_pools_drain_to_full(eng: Engine) -> None:
    """Idle, with the cache evicted: every page and slot is back on its free list."""
    eng.check_invariants()
    eng.memory.evict_pages(10**9)
    eng.memory.evict_checkpoints(10**9)
    assert eng.kv.allocator.num_free == eng.kv.allocator.capacity
    assert eng.states.allocator.num_free == eng.states.allocator.capacity
