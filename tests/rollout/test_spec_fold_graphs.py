"""The graphed fold's padded function (rollout/spec/fold_graphs.py, run eagerly on CPU: capture=False) commits
the eager fold's KDA state, with its counts on the device, and checkpoints every chunk boundary a row may reach
(the ones it reaches hold the eager fold's state there, in the middle of a row's tokens or at its end), rows
packed ragged (a planner's verify) or dense (the graphed verify), through its own bucket's graph or a larger
one's. On CPU within fp32 rounding: the padded fold computes a block's gates in one call and CPU elementwise
kernels round by an element's place in the tensor (vectorized body or scalar tail), and the eager fold steps
only the rows still folding (the CPU's batched matmuls round by batch shape). The GPU twin (graphs captured and
replayed, bit for bit) is tests/gpu/test_spec_gpu.py."""

import pytest
import torch

from rollout.spec.fold_graphs import FoldGraphs
from rollout.spec.replay import PROJECTIONS, KDAInputs, fold, kda_mixers, with_checkpoints
from tests.rollout.common import engine

WIDTH = 5


def random_inputs(runner, lengths, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    inputs = KDAInputs(list(lengths))
    for layer, mixer in kda_mixers(runner.model).items():
        dim = mixer.heads * mixer.config.kda_head_dim
        widths = {"q_proj": dim, "k_proj": dim, "v_proj": dim, "f_b_proj": dim, "b_proj": mixer.heads}
        assert set(widths) == set(PROJECTIONS)
        inputs.layers[layer] = {
            p: torch.randn(1, sum(lengths), c, generator=g).to(runner.device, dtype) for p, c in widths.items()
        }
    return inputs


def randomize_states(states, seed):
    g = torch.Generator().manual_seed(seed)
    for table in (states.conv, states.recurrent):
        for t in table.values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)


def snapshot(states):
    return {name: {k: v.clone() for k, v in getattr(states, name).items()} for name in ("conv", "recurrent")}


SLOTS = [0, 3, 1, 4, 2, 5]  # six rows: bucket 6 of max_running 6
POSITIONS = [0, 5, 6, 7, 62, 19]  # chunk 8: rows 1-4 cross a boundary mid-fold when counts reach it, 5 ends on one


def fold_both_ways(eng, counts, dense, larger, capture, dtype=torch.float32):
    """Fold six rows' random inputs from random states with the eager fold, then with `FoldGraphs`, each from
    the same start. -> (eager states, eager checkpoints, graphed states, graphed checkpoints, graphed taken,
    the FoldGraphs), checkpoints by (row, position) for the boundaries rows reached."""
    runner, states = eng.runner, eng.states
    lengths = [WIDTH] * 6 if dense else [1, 3, 3, 5, 5, 5]  # a ragged verify feeds at least the committed tokens
    inputs = random_inputs(runner, lengths, seed=1, dtype=dtype)
    randomize_states(states, seed=2)
    start = snapshot(states)

    def run(folder):
        for name in ("conv", "recurrent"):
            for k, v in getattr(states, name).items():
                v.copy_(start[name][k])
        copies = []

        def checkpoint(rows):  # what CacheManager.snapshots copies: the rows' working state, now
            copies.extend(
                {
                    name: {k: v[SLOTS[n]].clone() for k, v in getattr(states, name).items()}
                    for name in ("conv", "recurrent")
                }
                for n in rows
            )
            return list(range(len(copies) - len(rows), len(copies)))

        taken = folder(checkpoint)
        return (
            snapshot(states),
            {(n, pos): copies[snap] for n, pos, snap in taken if pos <= POSITIONS[n] + counts[n]},
            taken,
        )

    with torch.inference_mode():  # as the engine's step runs it: where the kernels run (CUDA), the decode step's
        want, want_seen, _ = run(
            lambda ck: with_checkpoints(
                lambda at: fold(runner.model, states, inputs, SLOTS, counts, POSITIONS, 8, at), counts, POSITIONS, 8, ck
            )
        )
    graphs = FoldGraphs(runner, WIDTH, capture=capture)
    if larger:
        graphs._static(12, inputs)
    got, got_seen, taken = run(
        lambda ck: graphs.fold(inputs, SLOTS, torch.tensor(counts, device=runner.device), POSITIONS, 8, ck)
    )
    assert sorted(graphs.graphs) == ([12] if larger else [6]) and graphs.captures == 1
    reached = {(n, p + 8 - p % 8) for n, (p, c) in enumerate(zip(POSITIONS, counts)) if 8 - p % 8 <= c}
    assert set(got_seen) == set(want_seen) == reached
    # every row whose verified tokens meet a boundary got a checkpoint, reached or not (the counts stay on the
    # device); the caller frees the unreached ones
    assert {n for n, _, _ in taken} == {n for n, (p, k) in enumerate(zip(POSITIONS, lengths)) if 8 - p % 8 <= k}
    assert graphs.replays == 2  # up to the boundaries, then the rest
    others = [i for i in range(states.sink_slot + 1) if i not in SLOTS]  # the sink, where padding rows sit, too
    for name in ("conv", "recurrent"):
        for k in want[name]:
            assert not torch.equal(got[name][k][SLOTS], start[name][k][SLOTS])  # the fold did write
            assert torch.equal(got[name][k][others], start[name][k][others]), (name, k)  # and nowhere else
    return want, want_seen, got, got_seen


@pytest.mark.parametrize(
    "dense,counts,larger",
    [
        (True, [5] * 6, False),
        (True, [1, 2, 3, 4, 5, 5], False),
        (False, [1, 2, 3, 4, 5, 5], False),
        (True, [5] * 6, True),
    ],
)
def test_the_padded_fold_commits_the_eager_folds_state(dense, counts, larger):
    """larger: six rows (bucket 8) folded through an already captured bucket 12, more padding rows."""
    want, want_seen, got, got_seen = fold_both_ways(
        engine(max_running=12 if larger else 6), counts, dense, larger, capture=False
    )
    assert (5, 24) in want_seen
    for key in want_seen:
        for name in ("conv", "recurrent"):
            for k in want_seen[key][name]:
                torch.testing.assert_close(got_seen[key][name][k], want_seen[key][name][k], atol=1e-6, rtol=0)
    for name in ("conv", "recurrent"):
        for k in want[name]:
            torch.testing.assert_close(got[name][k], want[name][k], atol=1e-6, rtol=0)


def test_a_row_that_commits_nothing_keeps_its_state_bit_for_bit_whatever_its_inputs():
    """A padded fold masks a row's tokens past its count by their inputs (decay 0, beta 0; no select over the
    recurrent state) and reads its conv state off the block's history: rows committing 0 tokens keep both
    states exactly, even with large inputs (saturated gates) over large states; the others move."""
    eng = engine(max_running=6)
    counts = [0, 5, 0, 3, 0, 5]
    inputs = random_inputs(eng.runner, [WIDTH] * 6, seed=3)
    for per in inputs.layers.values():
        for t in per.values():
            t.mul_(30.0)
    randomize_states(eng.states, seed=4)
    for t in eng.states.recurrent.values():
        t.mul_(5.0)
    start = snapshot(eng.states)
    graphs = FoldGraphs(eng.runner, WIDTH, capture=False)
    assert graphs.fold(inputs, SLOTS, torch.tensor(counts), [1] * 6, 64, lambda rows: []) == []  # no boundary
    for name in ("conv", "recurrent"):
        for k, t in getattr(eng.states, name).items():
            for n, c in enumerate(counts):
                assert torch.equal(t[SLOTS[n]], start[name][k][SLOTS[n]]) == (c == 0), (name, k, n)
