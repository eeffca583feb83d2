"""Speculative decoding's CUDA path (run on the device machine): the verify forward replayed from CUDA graphs by
batch bucket (rollout/spec/graphs.py) equals the eager packed verify, the drafter's graphed proposals equal its
eager ones (rollout/spec/draft_graphs.py), and greedy with speculation equals plain greedy, all in bf16 (the CPU
twin of the padded shapes, exact in fp32: tests/rollout/test_spec_graphs.py).

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_spec_gpu.py
"""

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from rollout.spec.replay import verify_forward
from tests.gpu.test_engine_cuda import CFG, assert_greedy_agree, prompts, small_model
from tests.rollout.test_spec_engine import ScriptedDrafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GAMMA = 4
PARAMS = SamplingParams(temperature=0, max_new_tokens=37)  # not a multiple of gamma + 1: blocks run past limits


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.fixture(scope="module")
def plain(model):
    ps = prompts([5, 20, 30, 40, 50], 1)
    return ps, Engine(model, EngineConfig(max_prefill_tokens=64, **CFG)).generate(ps, PARAMS)


def spec_engine(model, script, **kw) -> Engine:
    return Engine(
        model,
        EngineConfig(
            max_prefill_tokens=64,
            **CFG,
            **kw,
            speculation=SpecConfig(drafter=ScriptedDrafter(script, wrong=0.3), gamma=GAMMA),
        ),
    )


def test_greedy_speculation_with_graphed_verify_equals_plain_greedy(model, plain):
    ps, want = plain
    eng = spec_engine(model, {tuple(p): c.output_ids for p, c in zip(ps, want)})
    got = eng.generate(ps, PARAMS)
    strategy = eng.decoder.strategy
    graphs = strategy._verify_graphs[GAMMA + 1]
    assert strategy.graph_verify and graphs is not None and not graphs.failed
    assert graphs.captures > 0 and graphs.replays == strategy.stats.steps
    assert strategy.stats.verify_graphed == strategy.stats.fold_graphed == strategy.stats.steps  # all graphed
    assert strategy.stats.accepted > 0
    assert_greedy_agree(want, got)


def test_graphed_and_eager_verify_agree(model, plain):
    """The same engine state, one verify step both ways: logits within bf16 tolerance, the same argmax
    wherever the top two are apart, the same KDA inputs; then whole runs agree (eager: cuda_graphs off)."""
    ps, want = plain
    script = {tuple(p): c.output_ids for p, c in zip(ps, want)}
    eng = spec_engine(model, script)
    for p in ps:
        eng.submit(p, PARAMS)
    while not eng.scheduler.running or any(r.prefilling for r in eng.scheduler.running):
        eng.step()
    for _ in range(3):  # a few verify steps in: the rows have KV and KDA state of their own
        eng.step()
    strategy, batch = eng.decoder.strategy, list(eng.scheduler.running)
    block = torch.randint(
        3, 512, (len(batch), GAMMA + 1), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    graphs = strategy._graphs(GAMMA + 1)
    g_logits, g_inputs, _ = graphs.run(graphs.key(batch), batch, block)
    e_logits, e_inputs, _ = verify_forward(eng.runner, batch, block.flatten(), [GAMMA + 1] * len(batch))
    g_logits, e_logits = g_logits.float(), e_logits.float()
    torch.testing.assert_close(g_logits.log_softmax(-1), e_logits.log_softmax(-1), atol=5e-2, rtol=0)
    top2 = e_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert torch.equal(g_logits.argmax(-1)[clear], e_logits.argmax(-1)[clear])
    for layer, projections in e_inputs.layers.items():
        for name, t in projections.items():
            torch.testing.assert_close(g_inputs.layers[layer][name].float(), t.float(), atol=5e-2, rtol=5e-2)
    eager = spec_engine(model, script, cuda_graphs=False)
    assert not eager.decoder.strategy.graph_verify
    assert_greedy_agree(eager.generate(ps, PARAMS), spec_engine(model, script).generate(ps, PARAMS))


@pytest.mark.parametrize("dense,counts", [(True, [5] * 6), (True, [1, 2, 3, 4, 5, 5]), (False, [0, 2, 3, 4, 5, 5])])
def test_the_graphed_fold_commits_the_eager_folds_state_bit_for_bit(model, dense, counts):
    """The fold's graphs (a block's convs and gates in one call each, the recurrence in one `kda_advance` per
    layer, checkpoints mid-block) against the eager fold (token by token, the decode step's calls), bf16 inputs:
    the working states and every reached checkpoint equal bit for bit (the CPU twin, within fp32 rounding:
    tests/rollout/test_spec_fold_graphs.py)."""
    from tests.rollout.test_spec_fold_graphs import fold_both_ways

    eng = Engine(model, EngineConfig(max_prefill_tokens=64, **{**CFG, "max_running": 6}))
    want, want_seen, got, got_seen = fold_both_ways(
        eng, counts, dense, larger=False, capture=True, dtype=torch.bfloat16
    )
    for key in want_seen:
        for name in ("conv", "recurrent"):
            for k in want_seen[key][name]:
                assert torch.equal(got_seen[key][name][k], want_seen[key][name][k]), (key, name, k)
    for name in ("conv", "recurrent"):
        for k in want[name]:
            assert torch.equal(got[name][k], want[name][k]), (name, k)


def test_a_graphed_drafter_proposes_the_eager_drafts_on_cuda(model, plain):
    """A DSpark drafter on the bf16 engine: a whole speculative run through its graphed proposals equals plain
    greedy; its greedy and sampled proposals replayed from CUDA graphs (captured on a bucket's third ask)
    equal the eager block's at the graph's shape: the same drafts, q and confidences within tolerance."""
    from rollout.spec.drafter import DSparkConfig, DSparkDrafter

    ps, want = plain
    c = model.config
    torch.manual_seed(0)
    d = DSparkDrafter(
        DSparkConfig(target_layers=(1, 3), hidden_size=c.hidden_size, vocab_size=c.vocab_size, block_size=GAMMA)
    )
    eng = Engine(model, EngineConfig(max_prefill_tokens=64, **CFG, speculation=SpecConfig(drafter=d, gamma=GAMMA)))
    assert d.graphs is not None and d.graphs.capture
    got = eng.generate(ps, PARAMS)
    assert_greedy_agree(want, got)
    assert d.graphs.captures > 0 and d.graphs.replays == eng.decoder.strategy.stats.steps
    rows = list(range(5))
    anchors = torch.tensor([5, 6, 7, 8, 9], device="cuda")
    pad = next(b for b in d.graphs.batch_buckets if b >= 5) - 5  # the eager block at the graph's shape
    idx = torch.tensor(rows + [0] * pad, device="cuda")
    ids = torch.cat([anchors, anchors.new_zeros(pad)])
    temps = [1.0, 0.7, 1.3, 1.0, 0.9]
    seeds, at = torch.arange(5, device="cuda") + 11, torch.arange(5, device="cuda") + 40
    with torch.inference_mode():  # as the engine proposes
        for sampling in (None, (temps, seeds, at)):
            for _ in range(3):  # a bucket's graph is captured on its third ask
                got = d.graphs.run(rows, anchors, GAMMA, sampling)
            padded = (
                None
                if sampling is None
                else (
                    torch.tensor(temps + [1.0] * pad, device="cuda"),
                    torch.cat([seeds, seeds.new_zeros(pad)]),
                    torch.cat([at, at.new_zeros(pad)]),
                )
            )
            want = d._from_tensors(idx, ids, GAMMA, padded)
            assert torch.equal(got[0], want[0][:5])
            torch.testing.assert_close(got[2].float(), want[2][:5].float(), atol=2e-2, rtol=2e-2)
            if sampling is not None:
                torch.testing.assert_close(got[1], want[1][:5], atol=1e-5, rtol=1e-4)
    assert d.graphs.captures >= 2 and not d.graphs.failed
