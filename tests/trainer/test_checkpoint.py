"""Atomic run checkpoints: publish by rename, verify by manifest, skip damaged ones, prune."""

import logging

import pytest

from miles_k3.trainer import checkpoint as ckpt
from miles_k3.trainer.run_log import ORPHANED, truncate_metrics


def write_files(payload: bytes):
    def write(d):
        (d / "a.bin").write_bytes(payload)
        (d / "sub").mkdir()
        (d / "sub" / "b.txt").write_text("hello")

    return write


def test_save_verify_and_latest(tmp_path):
    p1 = ckpt.save_checkpoint(tmp_path, 1, write_files(b"one"))
    p2 = ckpt.save_checkpoint(tmp_path, 2, write_files(b"two"))
    assert ckpt.verify_checkpoint(p1) is None and ckpt.verify_checkpoint(p2) is None
    assert ckpt.latest_good(tmp_path) == p2
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2]
    with pytest.raises(FileExistsError):
        ckpt.save_checkpoint(tmp_path, 2, write_files(b"again"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove_manifest", "remove_file", "bad_manifest"])
def test_damaged_newest_is_skipped_with_a_warning(tmp_path, caplog, damage):
    p1 = ckpt.save_checkpoint(tmp_path, 1, write_files(b"one"))
    p2 = ckpt.save_checkpoint(tmp_path, 2, write_files(b"two-two"))
    if damage == "truncate":
        (p2 / "a.bin").write_bytes(b"tw")
    elif damage == "flip":
        (p2 / "a.bin").write_bytes(b"twX-two")
    elif damage == "remove_manifest":
        (p2 / ckpt.MANIFEST).unlink()
    elif damage == "remove_file":
        (p2 / "sub" / "b.txt").unlink()
    else:
        (p2 / ckpt.MANIFEST).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest_good(tmp_path) == p1
    assert "skipping damaged checkpoint" in caplog.text and p2.exists()


def test_failed_write_leaves_nothing_published(tmp_path):
    def boom(d):
        (d / "x").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ckpt.save_checkpoint(tmp_path, 3, boom)
    assert ckpt.list_checkpoints(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_stale_temporaries_are_cleared_and_prune_keeps_newest(tmp_path):
    (tmp_path / ".step_00000009.tmp-123").mkdir()
    for s in range(1, 5):
        ckpt.save_checkpoint(tmp_path, s, write_files(bytes([s])))
    assert not (tmp_path / ".step_00000009.tmp-123").exists()
    deleted = ckpt.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step_00000001", "step_00000002"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]


def test_truncate_metrics_moves_later_rows_and_torn_lines(tmp_path):
    rows = ['{"step": 1, "r": 0.1}', '{"step": 2, "r": 0.2}', '{"step": 3, "r": 0.3}', '{"step": 4, "r"']
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert truncate_metrics(tmp_path, 2) == 2
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == rows[:2]
    assert (tmp_path / ORPHANED).read_text().splitlines() == rows[2:]


def test_a_damaged_checkpoint_in_the_way_is_moved_aside_not_deleted(tmp_path):
    p2 = ckpt.save_checkpoint(tmp_path, 2, write_files(b"two"))
    (p2 / "a.bin").write_bytes(b"xx")
    again = ckpt.save_checkpoint(tmp_path, 2, write_files(b"new"))
    assert ckpt.verify_checkpoint(again) is None and (again / "a.bin").read_bytes() == b"new"
    (aside,) = tmp_path.glob("step_00000002.damaged-*")
    assert (aside / "a.bin").read_bytes() == b"xx"
