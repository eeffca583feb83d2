"""The batched sampler: greedy and truncated rows, per-request counter-based noise, exact untruncated
log-probs, sampled frequencies that follow the distribution, and the CUDA kernel (under Triton's
interpreter) against the torch definition."""

import textwrap

import pytest
import torch

from rollout import noise
from rollout.request import SamplingParams
from rollout.sampler import sample
from tests.rollout.interpreted import assert_interpreted_ok


def test_batched_sampler_truncation_seeds_and_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=1, seed=1),
        SamplingParams(temperature=1.3, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
    ]
    seeds, positions = [5, 1, 9, 2], [10, 11, 12, 13]
    tokens, logps = sample(logits, params, seeds, positions)
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    for b, (t, p) in enumerate(zip(tokens, params)):
        temp = p.temperature or 1.0
        assert logps[b] == pytest.approx(float(torch.log_softmax(logits[b] / temp, -1)[t]), abs=1e-5)
    assert tokens[3] in logits[3].topk(5).indices.tolist()
    # top_p 0.3 keeps the smallest sorted prefix reaching 30% of the mass
    probs = torch.softmax(logits[2] / 1.3, -1)
    sp, order = probs.sort(descending=True)
    allowed = order[(sp.cumsum(0) - sp) < 0.3].tolist()
    draws = {sample(logits[2:3], params[2:3], [s], [0])[0][0] for s in range(40)}
    assert draws <= set(allowed)
    # a row's draw depends on its own seed and position only: not on the batch, its order or its row
    again = sample(logits.flip(0), params[::-1], seeds[::-1], positions[::-1])[0]
    assert again == tokens[::-1]
    alone = sample(logits[3:], params[3:], seeds[3:], positions[3:])[0]
    assert alone == tokens[3:]


def test_sampled_frequencies_follow_the_distribution_over_seeds_and_over_positions():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    want = torch.softmax(logits[0] / 0.8, -1)
    n = 6000
    params = [SamplingParams(temperature=0.8)] * n
    over_seeds = sample(logits.repeat(n, 1), params, list(range(n)), [7] * n)[0]
    over_positions = sample(logits.repeat(n, 1), params, [3] * n, list(range(n)))[0]
    for tokens in (over_seeds, over_positions):
        freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
        chi2 = float(((freq - want.double()) ** 2 / want.double()).sum() * n)
        assert chi2 < 20.5, (freq, want)  # 4 degrees of freedom: p = 0.0004


def test_noise_is_uniform_and_unrelated_across_rows_positions_and_vocabulary():
    seeds = torch.tensor([0, 1, 2, 1 << 40, (1 << 62) - 1, 12345])
    u = noise.uniforms(seeds, torch.tensor([0, 0, 0, 5, 5, 1 << 31]), 4096)
    assert u.dtype == torch.float32 and bool((u > 0).all() and (u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    c = torch.corrcoef(u)  # rows: distinct seeds and positions
    assert float((c - torch.eye(len(seeds))).abs().max()) < 0.06
    assert abs(float(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1])) < 0.06  # neighbours in a row
    # a position moves the draw, and the same key gives the same words
    assert not torch.equal(noise.uniforms(seeds[:1], torch.tensor([1]), 64), u[:1, :64])
    assert torch.equal(noise.uniforms(seeds[:1], torch.tensor([0]), 64), u[:1, :64])


def test_a_seeds_streams_are_distinct_seeds_whose_noise_is_unrelated():
    """Stream 0 is the seed itself; other streams are deterministic seeds in [0, 2^62), distinct across streams
    and seeds, whose uniforms at the same position are uncorrelated with the seed's own."""
    seeds = [0, 1, 2, 1 << 40, (1 << 62) - 1, 12345]
    derived = {(s, k): noise.stream_seed(s, k) for s in seeds for k in range(4)}
    assert all(derived[(s, 0)] == s for s in seeds)
    assert all(0 <= v < noise.MAX_SEED for v in derived.values()) and len(set(derived.values())) == len(derived)
    assert noise.stream_seed(12345, 2) == derived[(12345, 2)]
    rows = torch.tensor([derived[(12345, k)] for k in range(4)])
    u = noise.uniforms(rows, torch.full((4,), 9), 4096)
    assert float((torch.corrcoef(u) - torch.eye(4)).abs().max()) < 0.06


def test_sampling_kernel_matches_the_definition_token_for_token():
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        os.environ["MILES_K3_KERNELS"] = "interpret"
        import torch
        from rollout import noise
        from rollout.kernels import sampling
        from rollout.request import SamplingParams
        from rollout.sampler import _sample_torch, sample_on_device

        g = torch.Generator().manual_seed(0)
        sampling.TARGET_PROGRAMS = 8  # small batches split their rows, as at batch 1 on the device
        for b, v, dtype in [(5, 300, torch.float32), (3, 5000, torch.bfloat16), (1, 9000, torch.float32),
                            (9, 33, torch.float16)]:
            logits = (torch.randn(b, v, generator=g) * 4).to(dtype)
            temps = [0.0 if i % 3 == 0 else 0.5 + i / 4 for i in range(b)]
            params = [SamplingParams(temperature=t) for t in temps]
            keys = torch.tensor([[17 * i + (1 << 40) for i in range(b)], [i * 3 for i in range(b)]])
            assert sampling.splits_for(b, v) == (8 if v > 8000 else 4 if v == 5000 else 1), (b, v)
            got = sampling.sample_rows(logits, torch.tensor(temps), keys)
            want = _sample_torch(logits, params, keys)
            assert torch.equal(got[0], want[0]), (b, v, got[0], want[0])
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=2e-5)
        # through the sampler: truncated rows take the definition, the others the kernel
        logits = torch.randn(4, 700, generator=g) * 3
        params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_k=3),
                  SamplingParams(temperature=0.0), SamplingParams(temperature=1.1, top_p=0.5)]
        got = sample_on_device(logits, params, [1, 2, 3, 4], [9, 9, 9, 9])
        keys = torch.tensor([[1, 2, 3, 4], [9, 9, 9, 9]])
        want = _sample_torch(logits, params, keys)
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], atol=2e-5)
        print("ok")
    """),
        timeout=600,
    )
