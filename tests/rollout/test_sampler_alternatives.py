"""The sampler's alternatives (top log-probs, given ids' log-probs) on the kernel path (Triton's interpreter on
CPU): rows that ask take the torch path, so their token, log-prob and alternatives come from one log-softmax;
the other rows keep the kernel's draws."""

import textwrap

from tests.rollout.interpreted import assert_interpreted_ok


def test_rows_asking_for_alternatives_draw_as_the_definition_and_report_its_log_softmax():
    assert_interpreted_ok(
        textwrap.dedent("""
        import os
        os.environ["MILES_K3_KERNELS"] = "interpret"
        import torch
        from rollout.request import SamplingParams
        from rollout.sampler import _sample_torch, sample_alternatives, unpack_alternatives

        g = torch.Generator().manual_seed(0)
        logits = torch.randn(5, 700, generator=g) * 3
        params = [
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, top_logprobs=4),
            SamplingParams(temperature=0.0, token_ids_logprob=(5, 9)),
            SamplingParams(temperature=1.1, top_p=0.5, top_logprobs=2, token_ids_logprob=(1,)),
            SamplingParams(temperature=0.9, top_k=3),
        ]
        keys = torch.tensor([[1, 2, 3, 4, 5], [9, 9, 9, 9, 9]])
        tokens, logps, alt = sample_alternatives(logits, params, keys)
        want = _sample_torch(logits, params, keys)
        assert torch.equal(tokens, want[0]) and torch.allclose(logps, want[1], atol=2e-5)
        asking = [1, 2, 3]
        got = unpack_alternatives(alt.tolist(), [params[i] for i in asking], 700)
        for i, (top, ids) in zip(asking, got):
            t = params[i].temperature or 1.0
            ref = torch.log_softmax(logits[i] / t, dim=-1)
            if params[i].top_logprobs:
                k = ref.topk(params[i].top_logprobs)
                assert [a for a, _ in top] == k.indices.tolist()
                assert torch.allclose(torch.tensor([v for _, v in top]), k.values, atol=1e-6)
                if int(tokens[i]) in dict(top):  # one log-softmax: the token's log-prob is its top entry
                    assert dict(top)[int(tokens[i])] == float(logps[i])
            else:
                assert top is None
            want_ids = list(params[i].token_ids_logprob)
            assert (ids is None) == (not want_ids)
            if want_ids:
                assert torch.allclose(torch.tensor(ids, dtype=torch.float64), ref[want_ids].double(), atol=1e-6)
        print("ok")
    """),
        timeout=600,
    )
