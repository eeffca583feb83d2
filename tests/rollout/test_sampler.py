"""The batched sampler: greedy and truncated rows, per-request seeds, exact untruncated log-probs, and
sampled frequencies that follow the distribution."""

import pytest
import torch

from rollout.request import SamplingParams
from rollout.sampler import sample

def test_batched_sampler_truncation_seeds_and_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=1, seed=1),
              SamplingParams(temperature=1.3, top_p=0.3), SamplingParams(temperature=1.0, top_k=5, top_p=0.9)]
    gens = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    tokens, logps = sample(logits, params, gens)
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(logits[1].argmax())
    for b, (t, p) in enumerate(zip(tokens, params)):
        temp = p.temperature or 1.0
        assert logps[b] == pytest.approx(float(torch.log_softmax(logits[b] / temp, -1)[t]), abs=1e-5)
    assert tokens[3] in logits[3].topk(5).indices.tolist()
    # top_p 0.3 keeps the smallest sorted prefix reaching 30% of the mass
    probs = torch.softmax(logits[2] / 1.3, -1)
    sp, order = probs.sort(descending=True)
    allowed = order[(sp.cumsum(0) - sp) < 0.3].tolist()
    draws = {sample(logits[2:3], params[2:3], [torch.Generator().manual_seed(s)])[0][0] for s in range(40)}
    assert draws <= set(allowed)
    # a seeded row's draw depends on its own generator only
    again = sample(logits.flip(0), params[::-1], [torch.Generator().manual_seed(2), None,
                                                   torch.Generator().manual_seed(1), None])[0]
    assert again[0] == tokens[3]


def test_sampler_frequencies_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(4000, 1)
    gens = [None] * 4000
    torch.manual_seed(0)
    tokens, _ = sample(logits, [SamplingParams(temperature=1.0)] * 4000, gens)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), rtol=0, atol=0.03)
