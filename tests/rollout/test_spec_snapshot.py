"""The snapshot baseline (rollout/spec/snapshot.py, `SpecConfig.rollback="snapshot"`): it commits the state
ReplaySSM's fold commits, bit for bit, after every step and for every accepted length 0..gamma (checkpoints
planted inside a block included), so its outputs are replay's; its draft window is gamma state snapshots."""

import pytest
import torch

from rollout.request import SamplingParams
from rollout.spec import SpecConfig
from tests.rollout.common import engine, prompt
from tests.rollout.test_spec_engine import GAMMA, ScriptedDrafter, script_for


def spec(rollback: str, drafter) -> object:
    return engine(speculation=SpecConfig(drafter=drafter, gamma=GAMMA, rollback=rollback))


def states(eng, ids: list[int]) -> dict:
    """Every running request's working state, by its submission index (request ids are process-wide)."""
    s = eng.states
    return {
        ids.index(r.req.request_id): {
            i: (s.conv[i][r.slot].clone(), s.recurrent[i][r.slot].clone()) for i in s.kda_layers
        }
        for r in eng.scheduler.running
    }


def assert_same_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        for layer in a[rid]:
            for x, y in zip(a[rid][layer], b[rid][layer]):
                assert torch.equal(x, y), f"request {rid}, layer {layer}"


@pytest.mark.parametrize("accept", range(GAMMA + 1))
def test_snapshots_commit_the_replay_state_bit_for_bit_for_every_accepted_length(accept):
    """Two requests (6 and 13 prompt tokens, chunks of 8: blocks cross chunk boundaries), every draft after
    the first `accept` wrong: after every step the working states are equal bit for bit, so are the
    outputs, and the checkpoints the prefix cache holds."""
    ps = [prompt(6, 21), prompt(13, 22)]
    params = SamplingParams(temperature=0, max_new_tokens=13)
    script = script_for(ps, params)
    engines = [spec(rb, ScriptedDrafter(script, accept=accept)) for rb in ("replay", "snapshot")]
    ids = [[e.submit(p, params) for p in ps] for e in engines]
    done = [{}, {}]
    while engines[0].has_work():
        for e, d in zip(engines, done):
            d.update((c.request_id, c) for c in e.step())
        assert engines[0].has_work() == engines[1].has_work()
        assert_same_states(states(engines[0], ids[0]), states(engines[1], ids[1]))
    for p, a, b in zip(ps, *ids):
        assert done[0][a].output_ids == done[1][b].output_ids == script[tuple(p)]
        assert done[0][a].logprobs == done[1][b].logprobs
    for p in ps:
        tokens = p + script[tuple(p)]
        found = [e.memory.match(None, tokens) for e in engines]
        assert found[0].prefix_len == found[1].prefix_len >= 8
        for layer in engines[0].states.kda_layers:
            for table in ("conv", "recurrent"):
                a, b = (getattr(e.states, table)[layer][m.checkpoint_slot] for e, m in zip(engines, found))
                assert torch.equal(a, b)
    strategies = [e.decoder.strategy for e in engines]
    assert strategies[0].stats.emitted == strategies[1].stats.emitted


def test_the_snapshot_window_holds_gamma_states_per_row():
    """What the benchmark reports: the snapshot window is gamma x (recurrent + conv) of every KDA layer,
    and ReplaySSM's window of the same steps is smaller."""
    p = prompt(9, 23)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    script = script_for([p], params)
    got = {}
    for rb in ("replay", "snapshot"):
        eng = spec(rb, ScriptedDrafter(script, wrong=0.0))
        eng.generate([p], params)
        got[rb] = eng.decoder.strategy.stats.window_bytes
        per_state = sum(eng.states.conv[i][0].nbytes + eng.states.recurrent[i][0].nbytes for i in eng.states.kda_layers)
    assert got["snapshot"] == GAMMA * per_state
    assert 0 < got["replay"] < got["snapshot"]


def test_a_bad_rollback_fails_by_field_name():
    with pytest.raises(ValueError, match="SpecConfig.rollback"):
        SpecConfig(drafter=ScriptedDrafter({}), rollback="copy")
