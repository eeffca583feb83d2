"""CP=2 (two processes, gloo, megatron's zigzag split) computes what one process computes: every token's
log-prob, their sum, and every LoRA gradient, for packed rows whose sequences cross chunk and rank
boundaries; the KDA relayout round trip is the identity, and CP without the relayout is caught."""

import pytest
import torch

from megatron_patches.context_parallel import _chunk_plan
from miles_k3.model.context import ZigzagLayout
from tests.megatron_patches import cp_worker
from tests.megatron_patches.common import spawn_world


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    return spawn_world(cp_worker.worker, 2, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def cp1():
    return {name: cp_worker.run_case(config, row) for name, (config, row) in cp_worker.cases().items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


@pytest.mark.parametrize("case", list(cp_worker.cases()))
def test_cp2_equals_one_process(cp1, cp2, case):
    want = cp1[case]
    for rank, got in enumerate(cp2):
        got = got[case]
        assert got["local_len"] == 16  # each rank ran half of the padded row
        assert _rel(got["logp"], want["logp"]) < 1e-10, (case, rank)
        assert _rel(got["loss"], want["loss"]) < 1e-10, (case, rank)
        assert got["grads"].keys() == want["grads"].keys()
        for key, g in want["grads"].items():
            assert g is not None and got["grads"][key] is not None, key
            assert g.norm() > 0, key
            assert _rel(got["grads"][key], g) < 1e-10, (case, rank, key)


def test_cp_without_the_kda_relayout_gives_other_logprobs(cp1, cp2):
    """A hybrid CP whose KDA runs on the zigzag tokens as if contiguous: silently different log-probs."""
    want = cp1["k3-tiny/padded"]["logp"]
    for got in cp2:
        assert _rel(got["no-relayout"]["logp"], want) > 1e-3


def test_relayout_round_trip_is_the_identity(cp2):
    for rank, got in enumerate(cp2):
        r = got["round-trip"]
        assert torch.equal(r["back"], r["x"])
        # rank r's segment is positions [16 r, 16 r + 16) in order
        assert torch.equal(r["segment"][0, :, 0], torch.arange(16 * rank, 16 * rank + 16, dtype=r["x"].dtype))
        # the gradient goes back to the zigzag token it came from: each rank's probe lands on the
        # positions it was applied to
        seg_probe = torch.cat([g["round-trip"]["probe"][0, :, 0] for g in cp2])  # [32] in position order
        assert torch.equal(r["grad"][0, :, 0], seg_probe[r["positions"]])


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_chunk_plan_moves_every_chunk_to_its_owner(size):
    """Every CP size: simulate the all-to-all of `_chunk_plan` for all ranks at once, both directions."""
    for forward in (True, False):
        layouts = [ZigzagLayout.split(8 * size, None, size, r) for r in range(size)]
        held = {r: (lay.chunks_of(r) if forward else (2 * r, 2 * r + 1)) for r, lay in enumerate(layouts)}
        want = {r: ((2 * r, 2 * r + 1) if forward else lay.chunks_of(r)) for r, lay in enumerate(layouts)}
        plans = [_chunk_plan(lay, forward) for lay in layouts]
        # messages from src to dst, in src's send order
        outbox = {}
        for src, (send, send_counts, _, _) in enumerate(plans):
            chunks = [held[src][i] for i in send]
            for dst, n in enumerate(send_counts):
                outbox[src, dst], chunks = chunks[:n], chunks[n:]
        for dst, (_, _, recv_counts, arrange) in enumerate(plans):
            got = []
            for src, n in enumerate(recv_counts):
                assert len(outbox[src, dst]) == n
                got += outbox[src, dst]
            assert [got[i] for i in arrange] == list(want[dst])


def test_zigzag_layout():
    layout = ZigzagLayout.split(30, torch.tensor([0, 11, 13, 27, 30]), size=2, rank=1)
    assert layout.bounds == (0, 11, 13, 27, 30, 32) and layout.chunk == 8
    assert layout.positions.tolist() == list(range(8, 24))
    assert layout.segment == (16, 32) and layout.segment_bounds_of(1) == [0, 11, 14, 16]
    assert layout.continues(1) and not layout.continues(0)
    assert layout.segment_start_of_sequence(1) == 13
    r0 = ZigzagLayout.split(30, torch.tensor([0, 11, 13, 27, 30]), size=2, rank=0)
    assert r0.positions.tolist() == [*range(8), *range(24, 32)] and r0.real.sum() == 14
    ids = torch.arange(30)[None]
    assert layout.unshard([r0.shard(ids), layout.shard(ids)]).tolist() == ids.tolist()
    mask = r0.attention_mask  # query at position 26 (sequence [13, 27)) sees keys 13..26
    assert mask[10].nonzero().flatten().tolist() == list(range(13, 27))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        ZigzagLayout.split(30, torch.tensor([0, 12, 11, 30]), size=2, rank=0)
