"""Lossless verification (rollout/spec/verify.py): sampled speculation emits the target's distribution (its
noise a function of seed, stream and position, reused at positions a step left undecided), a lossy
acceptance rule fails the same test, greedy keeps exactly the argmax run, and a row's draws depend on its
own seed and positions only."""

import itertools
import math

import pytest
import torch

from rollout.request import SamplingParams
from rollout.spec.verify import DRAFT, draw, stream_seeds, verify

V, L, GAMMA = 4, 3, 2  # vocabulary, tokens generated per chain, drafts per block
ROWS = 12_000


def chi2_bound(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 1e-3 (Wilson-Hilferty): a correct sampler exceeds it 1 time in 1000."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target of a draw, written out independently of the code under test: softmax at the temperature,
    the top-k kept, renormalized."""
    p = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k:
        kth = p.topk(params.top_k, dim=-1).values[..., -1:]
        p = torch.where(p >= kth, p, torch.zeros_like(p))
    return p / p.sum(-1, keepdim=True)


def speculate(target: torch.Tensor, draft: torch.Tensor, params: SamplingParams, rows: int, rule=verify):
    """`rows` independent chains of L tokens after token 0 from a Markov target (logits target[prev]),
    drafted from a Markov drafter (logits draft[prev]) in blocks of GAMMA, verified by `rule`. Row i is a
    request of seed 1000 + i whose anchor sits at position len(out[i]) - 1."""
    seeds = [1000 + i for i in range(rows)]
    out = [[0] for _ in range(rows)]
    plist = [params] * rows
    while min(len(o) for o in out) <= L:
        anchor = torch.tensor([o[-1] for o in out])
        at = torch.tensor([len(o) - 1 for o in out])
        drafts, qs, prev = [], [], anchor
        for k in range(1, GAMMA + 1):
            tok, q = draw(draft[prev], plist, stream_seeds(seeds, DRAFT, "cpu"), at + k)
            drafts.append(tok)
            qs.append(q)
            prev = tok
        drafts, q = torch.stack(drafts, 1), torch.stack(qs, 1)
        fed = torch.cat([anchor[:, None], drafts], 1)  # the verify forward sees anchor, d1 .. dG
        tokens, _, counts = rule(target[fed], drafts, q, plist, seeds, at)
        for o, t, c in zip(out, tokens.tolist(), counts.tolist()):
            o.extend(t[:c])
    return [tuple(o[1 : L + 1]) for o in out]


def exact(target: torch.Tensor, params: SamplingParams) -> dict[tuple, float]:
    p = warped(target, params)
    probs = {}
    for seq in itertools.product(range(V), repeat=L):
        prev, pr = 0, 1.0
        for t in seq:
            pr *= float(p[prev, t])
            prev = t
        probs[seq] = pr
    return probs


def chi2(samples: list[tuple], probs: dict[tuple, float]) -> float:
    counts = {s: 0 for s in probs}
    for s in samples:
        counts[s] += 1
    n = len(samples)
    return sum((counts[s] - n * p) ** 2 / (n * p) for s, p in probs.items() if p > 0)


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5
    draft = target + torch.randn(V, V, generator=g, dtype=torch.float64)  # close, not equal
    return target, draft


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3)], ids=["t1", "t0.8-topk3"]
)
def test_sampled_speculation_emits_the_target_distribution(params):
    """Chains of L tokens from a Markov target, drafted by a different Markov drafter: the empirical law of
    the 64 sequences is the target's (chi-square under its 1e-3 quantile, fp64); the same test with a
    lossy rule (accept every draft) fails it by far."""
    target, draft = tables(0)
    probs = exact(target, params)
    df = sum(p > 0 for p in probs.values()) - 1
    assert chi2(speculate(target, draft, params, ROWS), probs) < chi2_bound(df)

    def accept_all(logits, drafts, q, plist, seeds, at):
        tokens, logps, _ = verify(logits, drafts, q, plist, seeds, at)
        return torch.cat([drafts, tokens[:, -1:]], 1), logps, torch.full((drafts.shape[0],), GAMMA + 1)

    assert chi2(speculate(target, draft, params, ROWS // 4, accept_all), probs) > 5 * chi2_bound(df)


def test_an_exact_drafter_is_always_accepted():
    """q == p': every draft survives (the ratio is 1), so a row emits gamma + 1 tokens per block."""
    target, _ = tables(1)
    params = SamplingParams(temperature=1.0)
    seeds, at = list(range(64)), torch.zeros(64, dtype=torch.long)
    anchor = torch.zeros(64, dtype=torch.long)
    tok1, q1 = draw(target[anchor], [params] * 64, stream_seeds(seeds, DRAFT, "cpu"), at + 1)
    tok2, q2 = draw(target[tok1], [params] * 64, stream_seeds(seeds, DRAFT, "cpu"), at + 2)
    drafts = torch.stack([tok1, tok2], 1)
    _, _, counts = verify(
        target[torch.cat([anchor[:, None], drafts], 1)], drafts, torch.stack([q1, q2], 1), [params] * 64, seeds, at
    )
    assert counts.tolist() == [GAMMA + 1] * 64


def test_greedy_keeps_the_argmax_run_and_reports_temperature_one_logprobs():
    """A greedy row keeps drafts while they equal the logits' argmax and then emits the argmax; its
    log-probs are the temperature-1 ones at every emitted position; `num_drafts` caps what is verified."""
    logits = torch.randn(3, GAMMA + 1, 7, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1)
    drafts = torch.stack(
        [best[0, :2], torch.stack([best[1, 0], (best[1, 1] + 1) % 7]), torch.stack([(best[2, 0] + 1) % 7, best[2, 1]])]
    )
    greedy = [SamplingParams(temperature=0)] * 3
    at = torch.zeros(3, dtype=torch.long)
    tokens, logps, counts = verify(logits, drafts, torch.zeros(3, GAMMA, 7), greedy, [0] * 3, at)
    assert counts.tolist() == [3, 2, 1]
    assert tokens[0].tolist() == best[0].tolist()
    assert tokens[1, :2].tolist() == best[1, :2].tolist() and tokens[2, 0] == best[2, 0]
    ref = torch.log_softmax(logits, -1).gather(2, tokens[..., None])[..., 0]
    assert torch.equal(logps, ref)
    _, _, capped = verify(logits, drafts, torch.zeros(3, GAMMA, 7), greedy, [0] * 3, at, num_drafts=[1, 2, 0])
    assert capped.tolist() == [2, 2, 1]
    # greedy verification reads no q: a drafter's all-greedy draw gives none, and the same tokens come out
    tok, q = draw(logits[:, 0], greedy, stream_seeds([0] * 3, DRAFT, "cpu"), at + 1)
    assert q is None and torch.equal(tok, best[:, 0])
    again, again_logps, again_counts = verify(logits, drafts, None, greedy, [0] * 3, at)
    assert torch.equal(again, tokens) and torch.equal(again_logps, logps) and again_counts.tolist() == [3, 2, 1]
    with pytest.raises(ValueError, match="q"):  # a sampled row without its q, by name
        verify(logits, drafts, None, [SamplingParams(temperature=1.0)] * 3, [0] * 3, at)


def test_a_rows_draws_do_not_depend_on_its_batch():
    """A row's drafts and verified tokens are the same alone and among other rows (other seeds, positions), and
    change with its seed."""
    target, draft = tables(3)
    params = SamplingParams(temperature=1.0)

    def run(n_rows, seed=7):
        seeds = [seed] + [100 + i for i in range(n_rows - 1)]
        at = torch.tensor([5] + [i % 3 for i in range(n_rows - 1)])
        anchor = torch.zeros(n_rows, dtype=torch.long)
        tok, q = draw(draft[anchor], [params] * n_rows, stream_seeds(seeds, DRAFT, "cpu"), at + 1)
        tokens, logps, counts = verify(
            target[torch.stack([anchor, tok], 1)], tok[:, None], q[:, None], [params] * n_rows, seeds, at
        )
        return tok[0].item(), tokens[0, : counts[0]].tolist(), logps[0, : counts[0]].tolist()

    assert run(1) == run(9)
    assert len({tuple(run(1, seed)[1]) for seed in range(12)}) > 1


def test_the_sampling_kernel_draws_the_definitions_drafts_and_final_tokens():
    """Through Triton's interpreter: with the kernels on, `draw` and `verify` emit the tokens of the torch
    definition, the residual's zeros (log -inf) included."""
    import textwrap

    from tests.rollout.interpreted import assert_interpreted_ok

    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        import torch
        from rollout.request import SamplingParams
        from rollout.spec.verify import DRAFT, draw, stream_seeds, verify

        def run():
            g = torch.Generator().manual_seed(0)
            target, draft = torch.randn(40, 40, generator=g) * 2, torch.randn(40, 40, generator=g) * 2
            params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 0.0)] * 4
            seeds, at = list(range(12)), torch.arange(12) * 5
            anchor = torch.arange(12) % 40
            tok, q = draw(draft[anchor], params, stream_seeds(seeds, DRAFT, "cpu"), at + 1)
            fed = torch.stack([anchor, tok], 1)
            tokens, logps, counts = verify(target[fed], tok[:, None], q[:, None], params, seeds, at)
            return tok, tokens, counts

        from miles_k3 import kernels

        os.environ["MILES_K3_KERNELS"] = "0"
        kernels.reset()
        want = run()
        os.environ["MILES_K3_KERNELS"] = "interpret"
        kernels.reset()
        assert kernels.available("cpu")
        got = run()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
        assert (want[2] == 1).any() and (want[2] == 2).any()  # rejections (residual draws) and acceptances
        print("ok")
    """),
        timeout=600,
    )
