"""The graphed fold's padded function (rollout/spec/fold_graphs.py, run eagerly on CPU: capture=False) commits
the eager fold's KDA state, with its counts on the device, and checkpoints every chunk boundary a row may reach
(the ones it reaches hold the eager fold's state there, in the middle of a row's tokens or at its end):
bit for bit when every row commits the whole block (the eager fold then steps the same rows at every
position), within fp32 rounding for committed counts 1..width (the eager fold steps only the rows still
folding, and the CPU's batched matmuls round by batch shape) or through a larger bucket's graph, rows packed
ragged (a planner's verify) or dense (the graphed verify). The GPU twin (graphs captured and replayed) is tests/gpu/test_spec_gpu.py."""

import pytest
import torch

from rollout.spec.fold_graphs import FoldGraphs
from rollout.spec.replay import PROJECTIONS, KDAInputs, fold, kda_mixers, with_checkpoints
from tests.rollout.common import engine

WIDTH = 5


def random_inputs(runner, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = KDAInputs(list(lengths))
    for layer, mixer in kda_mixers(runner.model).items():
        dim = mixer.heads * mixer.config.kda_head_dim
        widths = {"q_proj": dim, "k_proj": dim, "v_proj": dim, "f_b_proj": dim, "b_proj": mixer.heads}
        assert set(widths) == set(PROJECTIONS)
        inputs.layers[layer] = {p: torch.randn(1, sum(lengths), c, generator=g) for p, c in widths.items()}
    return inputs


def randomize_states(states, seed):
    g = torch.Generator().manual_seed(seed)
    for table in (states.conv, states.recurrent):
        for t in table.values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)


def snapshot(states):
    return {name: {k: v.clone() for k, v in getattr(states, name).items()} for name in ("conv", "recurrent")}


@pytest.mark.parametrize("dense,counts,larger", [(True, [5] * 6, False), (True, [1, 2, 3, 4, 5, 5], False),
                                                 (False, [1, 2, 3, 4, 5, 5], False), (True, [5] * 6, True)])
def test_the_padded_fold_commits_the_eager_folds_state(dense, counts, larger):
    """larger: six rows (bucket 8) folded through an already captured bucket 12, more padding rows."""
    eng = engine(max_running=12 if larger else 6)
    runner, states = eng.runner, eng.states
    slots = [0, 3, 1, 4, 2, 5]  # six rows: bucket 6 of max_running 6
    lengths = [WIDTH] * 6 if dense else [1, 3, 3, 5, 5, 5]  # a ragged verify feeds at least the committed tokens
    positions = [0, 5, 6, 7, 62, 19]  # chunk 8: rows 1-4 cross a boundary mid-fold when counts reach it, 5 ends on one
    exact = all(c == WIDTH for c in counts) and not larger  # the CPU's matmuls round by batch shape
    inputs = random_inputs(runner, lengths, seed=1)
    randomize_states(states, seed=2)
    start = snapshot(states)

    def run(folder):
        for name in ("conv", "recurrent"):
            for k, v in getattr(states, name).items():
                v.copy_(start[name][k])
        copies = []

        def checkpoint(rows):  # what CacheManager.snapshots copies: the rows' working state, now
            copies.extend({name: {k: v[slots[n]].clone() for k, v in getattr(states, name).items()}
                           for name in ("conv", "recurrent")} for n in rows)
            return list(range(len(copies) - len(rows), len(copies)))
        taken = folder(checkpoint)
        return snapshot(states), {(n, pos): copies[snap] for n, pos, snap in taken
                                  if pos <= positions[n] + counts[n]}, taken

    want, want_seen, _ = run(lambda ck: with_checkpoints(
        lambda at: fold(runner.model, states, inputs, slots, counts, positions, 8, at), counts, positions, 8, ck))
    graphs = FoldGraphs(runner, WIDTH, capture=False)
    if larger:
        graphs._static(12, inputs)
    got, got_seen, taken = run(lambda ck: graphs.fold(inputs, slots, torch.tensor(counts), positions, 8, ck))
    assert sorted(graphs.graphs) == ([12] if larger else [6]) and graphs.captures == 1
    reached = {(n, p + 8 - p % 8) for n, (p, c) in enumerate(zip(positions, counts)) if 8 - p % 8 <= c}
    assert (5, 24) in reached and set(got_seen) == set(want_seen) == reached
    # every row whose verified tokens meet a boundary got a checkpoint, reached or not (the counts stay on the
    # device); the caller frees the unreached ones
    assert {n for n, _, _ in taken} == {n for n, (p, k) in enumerate(zip(positions, lengths)) if 8 - p % 8 <= k}
    assert graphs.replays == 2  # up to the boundaries, then the rest

    def same(a, b):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for key in want_seen:
        for name in ("conv", "recurrent"):
            for k in want_seen[key][name]:
                same(got_seen[key][name][k], want_seen[key][name][k])
    for name in ("conv", "recurrent"):
        for k in want[name]:
            same(got[name][k], want[name][k])
            assert not torch.equal(got[name][k][slots], start[name][k][slots])  # the fold did write


def test_a_masked_row_keeps_its_recurrent_state_bit_for_bit_through_its_inputs():
    """decode_kda_step(active=...) leaves an inactive row's recurrent state exactly as it was (decay 0, beta 0:
    no select over the state) and steps an active row exactly as without the mask, whatever the inputs."""
    from rollout.spec.replay import decode_kda_step

    eng = engine(max_running=4)
    layer, mixer = next(iter(kda_mixers(eng.runner.model).items()))
    inputs = random_inputs(eng.runner, [1] * 4, seed=3)
    raw = {p: t[0][:, None] * 30.0 for p, t in inputs.layers[layer].items()}  # large: saturated gates
    g = torch.Generator().manual_seed(4)
    conv = torch.randn(eng.states.conv[layer][:4].shape, generator=g)
    rec = torch.randn(eng.states.recurrent[layer][:4].shape, generator=g) * 5.0
    active = torch.tensor([True, False, True, False])
    with torch.inference_mode():
        _, masked = decode_kda_step(mixer, raw, conv, rec, active)
        _, plain = decode_kda_step(mixer, raw, conv, rec)
    assert torch.equal(masked[~active], rec[~active])
    assert torch.equal(masked[active], plain[active]) and not torch.equal(plain[~active], rec[~active])
