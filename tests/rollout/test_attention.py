"""The MLA seam: the shared `MLAMixer.forward` takes its attention from the engine's cache (absorbed, over the
KV pages) and equals the layer's own reference attention over a dense cache; the dense cache declines."""

import torch

from miles_k3.model import DenseStateCache
from miles_k3.model.layers import MLAMixer
from rollout.memory import KDAStatePool, KVPagePool, PoolSizes
from rollout.state_cache import BatchLayout, PoolStateCache
from tests.rollout.common import MODEL


def test_paged_absorbed_attention_equals_the_reference_through_the_shared_forward():
    mixer = next(m for m in MODEL.modules() if isinstance(m, MLAMixer))
    assert "forward" not in mixer.__dict__  # a seam, not a replaced method
    c = MODEL.config
    sizes = PoolSizes.from_budget(c, 4 << 20, page_size=4, state_fraction=0.5, dtype=torch.float32)
    kv, states = KVPagePool(c, sizes, torch.float32, "cpu"), KDAStatePool(c, sizes, torch.float32, "cpu")
    pages = [kv.allocator.alloc(3), kv.allocator.alloc(3)]  # 12 positions each, interleaved in the pool
    dense = DenseStateCache(c)
    g = torch.Generator().manual_seed(0)
    pos = 0
    for t in (6, 1, 3):  # a prefill chunk, a decode token, another chunk: each sees the history before it
        x = torch.randn(2, t, c.hidden_size, generator=g)
        layout = BatchLayout.build(kv, [0, 1], [pos, pos], [t, t], pages, "cpu")
        with torch.no_grad():
            assert dense.mla_attention(mixer, None, None, None) is None
            want = mixer(x, dense)
            got = mixer(x, PoolStateCache(kv, states, layout))
        dense.advance(t)
        pos += t
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
