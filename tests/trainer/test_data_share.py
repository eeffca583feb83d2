"""`data_share`: each data-parallel rank trains on whole groups; a rank left without one (fewer kept groups
than ranks) gets a stand-in of weight 0, so it still runs the step's collectives and adds nothing."""

from miles_k3.trainer.batch import TrainBatch
from miles_k3.trainer.micro_batches import data_share, micro_batches


def batch(groups: list[int]) -> TrainBatch:
    n = len(groups)
    return TrainBatch.of([[1, 2]] * n, [[3, 4, 5]] * n, [[-0.5] * 3] * n, [0.5] * n, groups)


def test_ranks_share_whole_groups_with_full_weight():
    b = batch([0, 0, 1, 1, 2, 2])
    shares = [data_share(b, 2, r) for r in range(2)]
    assert [w for _, w in shares] == [1.0, 1.0]
    assert sorted(g for s, _ in shares for g in s.group_ids) == b.group_ids
    (first, _), (second, _) = shares
    assert not set(first.group_ids) & set(second.group_ids)


def test_a_rank_without_a_group_gets_a_stand_in_of_weight_zero():
    b = batch([7, 7])
    (first, w0), (stand_in, w1) = data_share(b, 2, 0), data_share(b, 2, 1)
    assert (w0, w1) == (1.0, 0.0) and stand_in.group_ids == first.group_ids == [7, 7]
    pieces = micro_batches(stand_in, None, "cpu", w1)
    assert [p.weight for p in pieces] == [0.0] and pieces[0].tokens == 0  # counts no loss-carrying tokens
    assert micro_batches(first, None, "cpu", w0)[0].tokens == 6


def test_one_rank_takes_the_whole_batch():
    b = batch([0, 1])
    assert data_share(b, 1, 0) == (b, 1.0)


def test_a_step_with_fewer_groups_than_ranks_is_the_single_ranks(tmp_path):
    """DP=2 with EP=2 inside it (the expert dispatch needs both ranks in every forward) on one group: rank 1
    trains on a stand-in, and the update's loss, gradient norm and entropy are one rank's."""
    from tests.megatron_patches.common import spawn_world
    from tests.trainer import dp_worker

    common = ("trainer.deterministic=true",)
    (one,) = spawn_world(dp_worker.worker, 1, _dir(tmp_path / "one"), common)
    both = spawn_world(dp_worker.worker, 2, _dir(tmp_path / "ep2"), (*common, "parallel=ep2"))
    for got in both:
        for name in ("loss", "grad_norm", "entropy", "pg_loss"):
            assert abs(got[name] - one[name]) <= 1e-5 * max(1.0, abs(one[name])), (name, got[name], one[name])


def _dir(path):
    path.mkdir()
    return path
