"""Top log-probs, given ids' log-probs and prompt log-probs under speculative decoding (rollout/spec/strategy.py:
a verify step reads them from its own logits at every verified position, a plain step with its sample, the
prompt's from the engine's prefill). Greedy: the speculating engine's answers equal the plain engine's (tokens
and top ids exact, every log-prob within 1e-5), for a scripted and a DSpark drafter, the packed and the graphed
(padded, eager on CPU) verify, verify and plain steps, in a batch mixing requests with and without
alternatives. Seeded sampled: speculation draws other tokens than plain sampling (its own noise streams), so
its alternatives are held against the model's log-softmax over the tokens it emitted, and asking for them
changes no token or log-prob; streamed and retracted too."""

from __future__ import annotations

import pytest
import torch

from miles_k3.model.cache import DenseStateCache
from rollout.engine import Engine
from rollout.request import Completion, SamplingParams
from rollout.spec import Drafter, SpecConfig
from rollout.spec.strategy import SpecDecode
from rollout.spec.verify import warp
from tests.rollout.common import MODEL, ROOMY, TIGHT, assert_pools_drain_to_full, engine, prompt
from tests.rollout.test_engine_logprobs import IDS, check_output, check_prompt
from tests.rollout.test_spec_engine import ScriptedDrafter, script_for, step_checked

GAMMA = 3
PROMPTS = [prompt(n, 40 + i) for i, n in enumerate([5, 12, 9, 17])]


def dspark() -> Drafter:
    """A random-init DSpark drafter for the test model: it taps the target's prefill (its acceptance is whatever
    it is; losslessness does not depend on it)."""
    from rollout.spec.drafter import DSparkConfig, DSparkDrafter

    c = MODEL.config
    torch.manual_seed(0)
    return DSparkDrafter(
        DSparkConfig(
            target_layers=(0, c.num_hidden_layers - 1),
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            block_size=GAMMA,
            context_window=16,
        )
    )


class OracleDrafter(Drafter):
    """Drafts from the target itself: each draft drawn (a seeded generator of its own) from p', the model's
    distribution at the request's temperature / top-k given the row's tokens and the drafts before it, q = p'
    (greedy rows: the argmax, q one-hot). Speculative sampling then accepts about every draft, so sampled
    requests emit several tokens a verify step."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, batch, anchors, gamma, params):
        drafts, qs = [], []
        for r, p in zip(batch, params):
            ids, row, q = r.req.prompt_ids + r.req.output_ids, [], []
            for _ in range(gamma):
                with torch.inference_mode():
                    logits = MODEL(torch.tensor([ids + row]), DenseStateCache(MODEL.config)).logits[0, -1:].float()
                _, target = warp(logits, [p])
                x = (
                    int(logits.argmax())
                    if p.temperature == 0
                    else int(torch.multinomial(target[0], 1, generator=self.gen))
                )
                row.append(x)
                q.append(
                    torch.nn.functional.one_hot(torch.tensor(x), logits.shape[-1]).float()
                    if p.temperature == 0
                    else target[0]
                )
            drafts.append(row)
            qs.append(torch.stack(q))
        return torch.tensor(drafts, device=anchors.device), torch.stack(qs).to(anchors.device)


def spec_engine(drafter: Drafter, memory: int = ROOMY, graphs: bool = False, max_batch: int | None = None, **kw):
    """graphs: the verify graphs' padded forward (eager on CPU) and the device-count fold; max_batch: batches
    above it take plain steps (one token a row through the sampler)."""
    spec = SpecConfig(drafter=drafter, gamma=GAMMA, max_batch=max_batch)
    eng = engine(memory, speculation=spec, **kw)
    if graphs:
        eng.decoder.strategy = SpecDecode(eng.runner, spec, graphs=True)
        eng.decoder.strategy.use_memory(eng.memory)
    return eng


def asking(**kw) -> list[SamplingParams]:
    """Per prompt: top log-probs and given ids with prompt log-probs from 0; top only; none (the plain rows of
    a mixed batch); given ids only, with prompt log-probs from 6."""
    return [
        SamplingParams(top_logprobs=4, token_ids_logprob=IDS, logprob_start_len=0, **kw),
        SamplingParams(top_logprobs=2, **kw),
        SamplingParams(**kw),
        SamplingParams(token_ids_logprob=IDS, logprob_start_len=6, **kw),
    ]


def assert_same(a: Completion, b: Completion) -> None:
    """b answers as a: tokens, top ids and finish exact; log-probs of every kind within 1e-5."""
    assert (b.output_ids, b.finish_reason) == (a.output_ids, a.finish_reason)
    assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    for x, y in [(a.top_logprobs, b.top_logprobs), (a.token_ids_logprobs, b.token_ids_logprobs)]:
        assert (x is None) == (y is None)
        assert len(x or []) == len(y or []) == (len(a.output_ids) if x is not None else 0)
    for x, y in zip(a.top_logprobs or [], b.top_logprobs or []):
        assert [t for t, _ in y] == [t for t, _ in x]
        assert [v for _, v in y] == pytest.approx([v for _, v in x], abs=1e-5)
    for x, y in zip(a.token_ids_logprobs or [], b.token_ids_logprobs or []):
        assert y == pytest.approx(x, abs=1e-5)
    assert (a.prompt is None) == (b.prompt is None)
    if a.prompt is not None:
        assert b.prompt.start == a.prompt.start
        assert b.prompt.logprobs == pytest.approx(a.prompt.logprobs, abs=1e-5, nan_ok=False)
        for x, y in [(a.prompt.top, b.prompt.top), (a.prompt.token_ids, b.prompt.token_ids)]:
            assert (x is None) == (y is None)
            for u, v in zip(x or [], y or []):
                if u is None or v is None:
                    assert u is v is None
                elif u and isinstance(u[0], tuple):
                    assert [t for t, _ in v] == [t for t, _ in u]
                    assert [s for _, s in v] == pytest.approx([s for _, s in u], abs=1e-5)
                else:
                    assert v == pytest.approx(u, abs=1e-5)


@pytest.mark.parametrize(
    "drafter, graphs, max_batch",
    [("scripted", False, None), ("scripted", True, None), ("scripted", False, 2), ("dspark", False, None)],
)
def test_greedy_alternatives_under_speculation_equal_the_plain_engines(drafter, graphs, max_batch):
    """A batch of four greedy requests (three asking for alternatives, two for prompt log-probs), then the
    same requests two at a time (max_batch 2: the batch of four takes plain steps, the pairs verify steps):
    every answer equals the plain engine's, and the verify steps accepted drafts (several tokens a step)."""
    params = asking(temperature=0, max_new_tokens=11)
    want = engine().generate(PROMPTS, params)
    scripted = ScriptedDrafter(script_for(PROMPTS, SamplingParams(temperature=0, max_new_tokens=11)))
    eng = spec_engine(scripted if drafter == "scripted" else dspark(), graphs=graphs, max_batch=max_batch)
    rounds = [list(range(4)), [0, 3], [1, 2]]
    for rows in rounds:
        ids = {i: eng.submit(PROMPTS[i], params[i]) for i in rows}
        done = step_checked(eng)
        for i in rows:
            assert_same(want[i], done[ids[i]])
    stats = eng.decoder.strategy.stats
    assert stats.steps > 0
    if drafter == "scripted":
        assert stats.accepted > 0
    if max_batch is not None:
        assert stats.plain_steps > 0
    if graphs:
        assert stats.verify_graphed == 0 and stats.fold_graphed == 0  # CPU: the graphs' shapes, run eagerly
    assert_pools_drain_to_full(eng)


def test_sampled_alternatives_under_speculation_are_the_models_distribution_and_change_no_draw():
    """Seeded sampled requests (with top-k / temperatures, beside a greedy one): each output token's top
    log-probs, given ids' log-probs and the prompt log-probs are the model's log-softmax at the request's
    temperature over the tokens emitted (as the plain engine's are), and the same requests without
    alternatives draw the same tokens with the same log-probs."""
    sampled = [
        SamplingParams(temperature=0.8, seed=1, max_new_tokens=10, top_logprobs=5, token_ids_logprob=IDS),
        SamplingParams(
            temperature=1.2,
            top_k=30,
            seed=2,
            max_new_tokens=10,
            top_logprobs=3,
            token_ids_logprob=IDS,
            logprob_start_len=2,
        ),
        SamplingParams(temperature=1.0, seed=3, max_new_tokens=10),
        SamplingParams(temperature=0, max_new_tokens=10, top_logprobs=4, token_ids_logprob=IDS, logprob_start_len=0),
    ]
    bare = [
        SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed, max_new_tokens=p.max_new_tokens)
        for p in sampled
    ]
    eng = spec_engine(OracleDrafter())
    got = eng.generate(PROMPTS, sampled)
    assert eng.decoder.strategy.stats.accepted > 0
    without = spec_engine(OracleDrafter()).generate(PROMPTS, bare)
    for c, b, p in zip(got, without, sampled):
        assert (c.output_ids, c.logprobs) == (b.output_ids, b.logprobs)  # exact: asking changes nothing
        if p.alternatives:
            check_output(c, p)
        if p.logprob_start_len >= 0:
            check_prompt(c, p)
    assert got[2].top_logprobs is None and got[2].token_ids_logprobs is None and got[2].prompt is None


def test_alternatives_under_speculation_survive_retraction_and_streaming():
    """A tight pool retracts speculating requests: each streamed event carries its token's alternatives, the
    first the prompt log-probs, all equal to the completion's and to the model's distribution."""
    params = SamplingParams(
        temperature=0.9, max_new_tokens=10, seed=5, top_logprobs=3, token_ids_logprob=IDS, logprob_start_len=1
    )
    prompts = [prompt(14, 20 + i) for i in range(3)]
    eng: Engine = spec_engine(OracleDrafter(), TIGHT["memory"], state_fraction=TIGHT["state_fraction"])
    ids = [eng.submit(p, params, stream=True) for p in prompts]
    events: dict[int, list] = {i: [] for i in ids}
    done = {}
    while eng.has_work():
        for c in eng.step():
            done[c.request_id] = c
        for i in ids:
            events[i] += eng.take_events(i)
        eng.check_invariants()
    assert eng.counters()["retractions"] > 0 and eng.decoder.strategy.stats.accepted > 0
    for i in ids:
        c = done[i]
        check_output(c, params)
        check_prompt(c, params)
        assert [e.token for e in events[i]] == c.output_ids
        assert [e.top for e in events[i]] == c.top_logprobs and [e.ids for e in events[i]] == c.token_ids_logprobs
        assert events[i][0].prompt == c.prompt and all(e.prompt is None for e in events[i][1:])
    assert_pools_drain_to_full(eng)
