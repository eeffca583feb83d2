"""Vocab-parallel embedding, head and log-probs: TP=2 (two processes, gloo) and TP=1 equal the full
computation (fp64) in log-probs, entropy and every gradient, with no chunk wider than [chunk, V/tp]."""

import pytest
import torch

from tests.megatron_patches import vocab_worker as w
from tests.megatron_patches.common import spawn_world


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return spawn_world(w.worker, 2, tmp_path_factory.mktemp("vocab_tp2"))


@pytest.fixture(scope="module")
def tp1():
    return w.run_cases()


def full_computation(case: dict) -> dict:
    """Plain torch on the whole vocabulary: logits [M, V], log_softmax, autograd."""
    t = w.tensors()
    hidden = t["hidden"].clone().requires_grad_(True)
    a, b = t["A"].clone().requires_grad_(True), t["B"].clone().requires_grad_(True)
    logits = hidden @ t["W"].t()
    if not case["tied"]:
        logits = logits + (hidden @ a.t()) @ b.t() * w.LORA.scale
    z = logits / case["temperature"]
    logp = z.log_softmax(-1).gather(-1, t["targets"][:, None]).squeeze(-1)
    (logp * t["weights"]).sum().backward()
    logq = z.detach().log_softmax(-1)
    entropy = -(logq.exp() * logq).sum(-1)
    return {
        "logp": logp.detach(),
        "entropy": entropy,
        "grad_hidden": hidden.grad,
        "grad_A": a.grad,
        "grad_B": b.grad,
        "embed": t["W"][t["ids"]],
    }


def _close(a, b, tol=1e-10):
    return a.shape == b.shape and float((a - b).norm()) <= tol * max(float(b.norm()), 1e-12)


@pytest.mark.parametrize("case", list(w.CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_equals_the_full_computation(tp1, tp2, case, tp):
    spec = w.CASES[case]
    want = full_computation(spec)
    for rank, got in enumerate([tp1] if tp == 1 else tp2):
        got = got[case]
        for key in ("logp", "entropy", "grad_hidden"):
            assert got[key].dtype == torch.float64 and _close(got[key], want[key]), (case, tp, rank, key)
        assert torch.equal(got["logp_nograd"], got["logp"]) and got["no_entropy"]
        if spec["tied"]:
            assert torch.equal(got["embed"], want["embed"])  # out-of-slice ids give 0, summed over TP
        else:
            assert _close(got["grad_A"], want["grad_A"])
            rows = want["grad_B"].chunk(tp)[rank]  # this rank's vocab rows of B
            assert _close(got["grad_B"], rows)
            # the head produced [chunk, V/tp] blocks, never all tokens' logits: each chunk in the forward, again
            # in the backward (the logits are recomputed, not saved), and in the forward without grad
            assert sorted(got["widths"]) == sorted(([(5, w.V // tp)] * 2 + [(3, w.V // tp)]) * 3)


def test_the_temperature_and_the_chunks_matter(tp1):
    """Guards the comparison: another temperature or a dropped chunk changes the result."""
    want = full_computation(w.CASES["untied-lora"] | {"temperature": 1.0})
    assert not _close(tp1["untied-lora"]["logp"], want["logp"], 1e-3)
    assert tp1["untied-lora"]["logp"].shape == (w.M,)


def test_bad_arguments_are_named():
    from megatron_patches.vocab_parallel import vocab_parallel_logprobs

    h, t = torch.zeros(3, 2), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        vocab_parallel_logprobs(lambda x: x, h, t, 1.0, chunk_size=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_logprobs(lambda x: x, h, t, 0.0)
    with pytest.raises(ValueError, match=r"targets \[M\]"):
        vocab_parallel_logprobs(lambda x: x, h, t[:2], 1.0)
