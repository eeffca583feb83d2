"""The engine records each token's routed experts (EngineConfig.record_routing): what the reference model's routers
choose over the same tokens, for prompt and generated tokens, through prefix hits, retraction and speculation."""

import torch

from miles_k3.model.routing import Routing, moe_layers
from rollout.request import SamplingParams
from tests.rollout.common import GREEDY, MODEL, TIGHT, drain, engine, prompt


def reference_routing(ids: list[int]) -> torch.Tensor:
    """The reference model's choices over `ids` in one plain forward: [len(ids), MoE layers, top_k]."""
    routing = Routing.of(MODEL, MODEL.config)
    with torch.no_grad(), routing.recording():
        MODEL(torch.tensor([ids]))
        return routing.table(len(ids))


def assert_recorded(c) -> None:
    ids = c.prompt_ids + c.output_ids
    table = c.routed_experts
    assert table.shape == (len(ids), len(moe_layers(MODEL.config)), MODEL.config.num_experts_per_token)
    assert (table[-1] == -1).all()  # the last output token was never fed
    want = reference_routing(ids[:-1])
    assert torch.equal(table[:-1].long().sort(-1).values, want.long().sort(-1).values)


def test_recorded_routing_is_the_reference_routers_choice_for_every_token():
    eng = engine(record_routing=True)
    params = [SamplingParams(max_new_tokens=9, seed=i) for i in range(3)]
    for c in eng.generate([prompt(21, 1), prompt(5, 2), prompt(40, 3)], params):
        assert_recorded(c)


def test_a_prefix_hit_reads_the_routing_that_computed_the_cached_pages():
    eng = engine(record_routing=True)
    p = prompt(33, 4)
    first = eng.generate([p], GREEDY)[0]
    again = eng.generate([p + first.output_ids[:3]], GREEDY)[0]
    assert again.cached_tokens > 0
    assert_recorded(again)
    n = len(p)
    assert torch.equal(again.routed_experts[:n], first.routed_experts[:n])


def test_routing_survives_retraction_under_memory_pressure():
    eng = engine(memory=TIGHT["memory"], state_fraction=TIGHT["state_fraction"], record_routing=True)
    ids = [eng.submit(prompt(12 + i, 10 + i), SamplingParams(max_new_tokens=12, seed=i)) for i in range(6)]
    done = drain(eng)
    assert eng.scheduler.num_retractions > 0
    for i in ids:
        assert_recorded(done[i])


def test_without_record_routing_there_is_no_table():
    eng = engine()
    (c,) = eng.generate([prompt(9, 5)], GREEDY)
    assert c.routed_experts is None and eng.runner.routing_table is None


def test_under_speculation_the_accepted_tokens_keep_the_verify_forwards_routing():
    """Rejected drafts write rows that later forwards overwrite, as their KV: every row read back is the
    reference's choice for the tokens that were kept."""
    from tests.rollout.test_spec_engine import ScriptedDrafter, script_for, spec_engine

    prompts = [prompt(14, 6), prompt(27, 7)]
    params = [SamplingParams(temperature=0, max_new_tokens=12)] * 2
    eng = spec_engine(ScriptedDrafter(script_for(prompts, params), wrong=0.4), record_routing=True)
    outs = eng.generate(prompts, params)
    assert sum(eng.decoder.strategy.drafter.counts) > 0
    for c in outs:
        assert_recorded(c)
