"""The drafter's context windows (rollout/spec/contexts.py): after any sequence of appends (a catch-up of up to a
whole window, then verify steps committing 1..5 features), each request's window is the latest `window`
features it was given, in order, exactly; a batch read holds them under a mask that covers them only; rows of finished
requests are reused, a retracted (unfinished) request keeps its window, and the
buffer grows past its first capacity without losing any."""

import random
from types import SimpleNamespace

import torch

from rollout.spec.contexts import ContextWindows

W, F = 6, 3


def request(rid: int):
    return SimpleNamespace(request_id=rid, finish_reason=None)


def test_windows_hold_the_latest_features_in_order_through_appends_drops_and_growth():
    rng = random.Random(0)
    windows = ContextWindows(W)
    want: dict[int, torch.Tensor] = {}
    reqs = {}
    counter = 0
    for step in range(40):
        if step % 7 == 6:  # some requests finish, one is retracted (unfinished, not in the batch): kept
            done = rng.sample(sorted(want), k=min(3, len(want)))
            for rid in done[:-1]:
                reqs[rid].finish_reason = "stop"
                del want[rid]
            live = set(want) - {done[-1]}
            windows.drop_finished(live)
            assert windows.ids() == set(want)
        batch = rng.sample(sorted(want), k=min(len(want), rng.randint(1, 5)))
        batch += [max(reqs, default=-1) + 1 + i for i in range(rng.randint(0, 3))]  # new requests
        counts, parts = [], []
        for rid in batch:
            reqs.setdefault(rid, request(rid))
            c = rng.randint(1, 2 * W) if rid not in want else rng.randint(1, 5)
            part = torch.arange(counter, counter + c, dtype=torch.float32)[:, None].expand(c, F) + 0.5
            counter += c
            pad = rng.randint(0, 2)  # a verify feeds more tokens than a row commits
            parts.append(torch.cat([part, torch.full((pad, F), -1.0)]))
            counts.append(c)
            want[rid] = torch.cat([want.get(rid, torch.empty(0, F)), part])[-W:]
        starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
        ends = [(windows.end(r) or 0) + c for r, c in zip(batch, counts)]
        windows.append([reqs[r] for r in batch], torch.cat(parts), starts, counts, ends)
        for rid, feats in want.items():
            assert torch.equal(windows.get(rid), feats), (step, rid)
        assert all(windows.end(r) == e for r, e in zip(batch, ends))
        ctx, mask = windows.read(batch)
        for i, rid in enumerate(batch):  # the real slots hold the window, in ring order (features increase)
            real = ctx[i][mask[i]]
            assert torch.equal(real[real[:, 0].argsort()], want[rid])
    assert windows.features.shape[0] > 8  # grew past its first capacity


def test_a_finished_requests_row_is_reused_and_starts_empty():
    windows = ContextWindows(W)
    a, b = request(1), request(2)
    windows.append([a], torch.ones(4, F), [0], [4], [4])
    row = windows.row_of[1]
    a.finish_reason = "stop"
    windows.drop_finished(set())
    windows.append([b], torch.full((2, F), 2.0), [0], [2], [2])
    assert windows.row_of[2] == row and torch.equal(windows.get(2), torch.full((2, F), 2.0))
    assert windows.end(1) is None and windows.end(2) == 2


def test_an_append_that_does_not_continue_a_window_starts_it_afresh():
    """A repeat or a gap in positions (a retracted request prefilled again) would leave stale slots real."""
    windows = ContextWindows(W)
    a = request(1)
    windows.append([a], torch.arange(4.0)[:, None].expand(4, F), [0], [4], [4])  # positions 0..3
    windows.append([a], torch.full((2, F), 9.0), [0], [2], [7])  # positions 5, 6: a gap at 4
    assert torch.equal(windows.get(1), torch.full((2, F), 9.0)) and windows.end(1) == 7
    windows.append([a], torch.full((1, F), 5.0), [0], [1], [8])  # continues at 7
    assert windows.get(1)[:, 0].tolist() == [9.0, 9.0, 5.0]


def test_an_append_writes_only_the_slots_of_the_positions_it_adds():
    windows = ContextWindows(W)
    reqs = [request(i) for i in range(3)]
    windows.append(reqs, torch.randn(3 * W, F), [0, W, 2 * W], [W] * 3, [W] * 3)
    before = windows.features.clone()
    windows.append(reqs[1:2], torch.full((2, F), 7.0), [0], [2], [W + 2])  # positions W, W + 1: slots 0, 1
    changed = (windows.features != before).any(-1).nonzero().tolist()
    assert changed == [[windows.row_of[1], 0], [windows.row_of[1], 1]]


def test_deferred_plain_steps_leave_the_windows_appends_one_at_a_time_would():
    """Plain steps (one position for every row of a batch) deferred, with `project` applied when read: runs
    of the same requests' next positions, a run longer than the window (its oldest steps never written), a
    run broken by a changed batch and one broken by a gap, and a verify-style append between runs, leave
    every window and end exactly as the projected features appended step by step. A run is projected and
    written once, when something reads the windows."""
    rng = random.Random(1)
    projected = []

    def project(raw):
        projected.append(raw.shape[0])
        return raw * 2.0 + 1.0

    deferred, stepwise = ContextWindows(W, project=project), ContextWindows(W)
    reqs = {i: request(i) for i in range(5)}
    pos = {i: 0 for i in reqs}
    counter = 0.0

    def step(ids, jump=0):
        nonlocal counter
        raw = torch.arange(counter, counter + len(ids))[:, None].expand(len(ids), F).clone()
        counter += len(ids)
        for i in ids:
            pos[i] += 1 + jump
        ends = [pos[i] for i in ids]
        deferred.defer([reqs[i] for i in ids], raw, ends)
        stepwise.append([reqs[i] for i in ids], raw * 2.0 + 1.0, list(range(len(ids))), [1] * len(ids), ends)

    for _ in range(2 * W + 1):  # longer than a window: one projection of its latest W steps
        step([0, 1, 2])
    assert projected == [] and deferred.row_of == {}
    for i in (0, 1, 2):
        assert torch.equal(deferred.get(i), stepwise.get(i)) and deferred.end(i) == stepwise.end(i)
    assert projected == [3 * W]
    for _ in range(3):
        step([0, 1, 2])
    step([1, 3])  # another batch: the run before it is written
    step([1, 3])
    step([1, 3], jump=2)  # a gap: a new run
    for _ in range(rng.randint(1, 4)):
        step([4, 1, 3])
    feats = torch.full((3, F), -5.0)  # a verify step's append between runs
    ends = [pos[0] + 3]
    pos[0] += 3
    deferred.append([reqs[0]], feats, [0], [3], ends)
    stepwise.append([reqs[0]], feats, [0], [3], ends)
    step([0, 2])
    for i in reqs:
        assert torch.equal(deferred.get(i), stepwise.get(i)) and deferred.end(i) == stepwise.end(i), i
    ctx, mask = deferred.read(list(reqs))
    want_ctx, want_mask = stepwise.read(list(reqs))
    assert torch.equal(mask, want_mask) and torch.equal(ctx[mask], want_ctx[want_mask])


def test_clear_forgets_the_windows_and_the_deferred_run():
    windows = ContextWindows(W, project=lambda raw: raw)
    a = request(1)
    windows.append([a], torch.ones(2, F), [0], [2], [2])
    windows.defer([a], torch.ones(1, F), [3])
    windows.clear()
    assert windows.ids() == set() and windows.end(1) is None
