"""The log-probs' recomputed logits (`vocab_parallel_logprobs(recompute_logits=True)`, the trainer's path):
the same log-probs, entropies and gradients as the path that saves each chunk's logits (fp64, 1e-12), with
LoRA dropout on the head replayed from its generator, and nothing of [chunk, V] kept for backward."""

from __future__ import annotations

import pytest
import torch

from megatron_patches.parallel import ensure_parallel
from megatron_patches.vocab_parallel import vocab_parallel_logprobs
from tests.megatron_patches import vocab_worker as w


def _run(recompute: bool, dropout: float, seed: int = 0) -> dict:
    t = w.tensors()
    spec = w.LORA.__class__(rank=w.LORA.rank, alpha=w.LORA.alpha, dropout=dropout, targets=w.LORA.targets)
    ensure_parallel()  # a single-process TP=1 world, left for the other tests of this process
    old, w.LORA = w.LORA, spec
    try:
        policy = w._policy(False, t)
    finally:
        w.LORA = old
    head = policy.lm_head
    generator = torch.Generator().manual_seed(seed)
    head.lora.generator = generator
    head.train()
    hidden = t["hidden"].clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        logp, entropy = vocab_parallel_logprobs(
            head,
            hidden,
            t["targets"],
            0.7,
            with_entropy=True,
            chunk_size=5,
            recompute_logits=recompute,
            generator=generator,
        )
    (logp * t["weights"]).sum().backward()
    return {
        "logp": logp.detach(),
        "entropy": entropy,
        "grad_hidden": hidden.grad,
        "grad_A": head.lora.A.grad,
        "grad_B": head.lora.B.grad,
        "rng": generator.get_state(),
        "widest_saved": max(x.numel() for x in saved if x.dim() == 2 and x is not hidden),
    }


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recomputed_logits_equal_the_saved_ones(dropout):
    want, got = _run(False, dropout), _run(True, dropout)
    for key in ("logp", "entropy", "grad_hidden", "grad_A", "grad_B"):
        assert got[key] is not None and float(got[key].norm()) > 0, key
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=key)
    assert torch.equal(got["rng"], want["rng"])  # the replay left the generator where the forward left it


def test_recompute_saves_no_logits():
    """Saved for backward: a chunk's logits [5, V] on the saving path; nothing wider than [5, D] recomputing."""
    assert _run(False, 0.0)["widest_saved"] >= 5 * w.V
    assert _run(True, 0.0)["widest_saved"] <= 5 * w.D
