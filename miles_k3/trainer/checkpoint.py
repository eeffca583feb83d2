"""Atomic run checkpoints: a directory per step, published by rename, verified by a manifest of checksums.

Layout: <run_dir>/checkpoints/step_<NNNNNNNN>/ holding whatever the trainer writes (adapter in PEFT format,
trainer_state.pt) plus manifest.json = {"step", "files": {relative path: {"bytes", "sha256"}}}.

Writing: the caller's `write(tmp_dir)` fills a temporary sibling (`.step_<N>.tmp-<pid>`); every file is
fsynced, the manifest is written last, then one `os.rename` publishes the directory and the parent directory
is fsynced. A crash at any point leaves either no `step_<N>` or a complete one; stale temporaries are removed
by the next save. Reading: `latest_good` walks the published checkpoints newest first and returns the first
whose manifest is present and whose every file matches its size and sha256; damaged ones are skipped with a
warning (never deleted: a person may want to look at them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.pt"  # what the driver writes into a checkpoint: step, sampler, every rank's state
ADAPTER_DIR = "adapter"  # and the adapter, in PEFT format
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: str | Path, step: int, write: Callable[[Path], None]) -> Path:
    """Publish checkpoint `step` atomically; returns its directory. Refuses to overwrite a good published
    step (FileExistsError: a resumed run continues after its checkpoint, so a clash means two runs share a
    dir). A damaged one in the way (a resume skipped it) is renamed to `step_<N>.damaged-<time>`, kept."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    if final.exists():
        problem = verify_checkpoint(final)
        if problem is None:
            raise FileExistsError(f"checkpoint {final} already exists")
        aside = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        log.warning("moving damaged checkpoint %s (%s) to %s", final, problem, aside.name)
        os.rename(final, aside)
    for stale in root.glob(".step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        write(tmp)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            files[path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync(manifest)
        _fsync(tmp)
        os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify_checkpoint(path: str | Path) -> str | None:
    """None when `path` is a complete, undamaged checkpoint; else what is wrong with it (a manifest of another
    layout, e.g. `files` a list, is damage too, never an exception). The manifest vouches for the bytes only:
    their contents are checked by the reader (`miles_k3.trainer.inputs.find_resume`)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        step = manifest["step"]
    except FileNotFoundError:
        return "no manifest.json (incomplete)"
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest.json ({e})"
    except OSError as e:
        return f"unreadable manifest.json ({e.strerror or e})"
    if isinstance(step, bool) or not isinstance(step, int):
        return f"manifest.json: step must be an integer, got {step!r}"
    if not isinstance(files, dict) or not all(
        isinstance(rel, str)
        and isinstance(meta, dict)
        and isinstance(meta.get("bytes"), int)
        and isinstance(meta.get("sha256"), str)
        for rel, meta in files.items()
    ):
        return 'manifest.json: files must map each relative path to {"bytes": int, "sha256": str}'
    if any(Path(rel).is_absolute() or ".." in Path(rel).parts for rel in files):
        return "manifest.json: files must be paths inside the checkpoint"
    if not _NAME.match(path.name) or int(_NAME.match(path.name).group(1)) != step:
        return f"manifest step {step} does not match the directory name"
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        if f.stat().st_size != meta["bytes"]:
            return f"{rel}: {f.stat().st_size} bytes, manifest says {meta['bytes']}"
        if _sha256(f) != meta["sha256"]:
            return f"{rel}: checksum mismatch"
    return None


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Published checkpoint directories (damaged or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found)


def latest_good(root: str | Path) -> Path | None:
    """The newest checkpoint that verifies; damaged newer ones are skipped with a warning."""
    for step, path in reversed(list_checkpoints(root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping damaged checkpoint %s: %s", path, problem)
    return None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` good checkpoints (damaged ones are left alone); returns the deleted."""
    good = [p for _, p in list_checkpoints(root) if verify_checkpoint(p) is None]
    doomed = good[:-keep] if keep > 0 else good
    for p in doomed:
        shutil.rmtree(p)
    return doomed
