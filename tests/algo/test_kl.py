"""KL estimators k1 / k2 / k3: known log-prob pairs, exact expectations, gradients, errors."""

import math

import pytest
import torch

from miles_k3.algo import kl_penalty

LN2 = math.log(2.0)


def test_known_pairs():
    # d = logp - ref:  p 0.5 vs ref 0.25 -> d = ln 2;  p 0.25 vs ref 0.5 -> d = -ln 2;  equal -> 0
    logp = torch.tensor([math.log(0.5), math.log(0.25), -3.0])
    ref = torch.tensor([math.log(0.25), math.log(0.5), -3.0])
    # k1 = d
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([LN2, -LN2, 0.0]))
    # k2 = d^2 / 2 = 0.2402265 for both signs
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([LN2**2 / 2, LN2**2 / 2, 0.0]))
    # k3 = exp(ref - logp) - (ref - logp) - 1:  0.5 + ln2 - 1 = 0.1931472;  2 - ln2 - 1 = 0.3068528
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 + LN2 - 1, 2 - LN2 - 1, 0.0]))


def test_k1_k3_unbiased_exact_expectation():
    # Over a whole categorical, E_p[k1] = E_p[k3] = KL(p || q) exactly (sum_v p_v k(v)); k2 is biased.
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(7, dtype=torch.float64), -1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum()
    torch.testing.assert_close((p * kl_penalty(logp, logq, "k1")).sum(), kl)
    torch.testing.assert_close((p * kl_penalty(logp, logq, "k3")).sum(), kl)
    assert (kl_penalty(logp, logq, "k3") >= 0).all() and (kl_penalty(logp, logq, "k2") >= 0).all()


@pytest.mark.parametrize(
    "kind, dkdd",
    [
        ("k1", lambda d: 1.0),
        ("k2", lambda d: d),
        ("k3", lambda d: 1.0 - math.exp(-d)),
    ],
)
def test_gradients_flow_to_logp_only(kind, dkdd):
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)], requires_grad=True)
    kl_penalty(logp, ref, kind).sum().backward()
    assert ref.grad is None
    torch.testing.assert_close(logp.grad, torch.tensor([dkdd(LN2)], dtype=torch.float32))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
