"""The error boundary of every command (`miles-train`, `miles-k3 *`, `miles-serve`): a user's mistake is one
line on stderr, "<prog>: error: <what, naming the flag, key, file or row>", and exit status 2.

`OneLineParser` makes argparse's own refusals (an unknown flag, a value of the wrong type) that one line,
without the usage block; `one_line` joins a multi-line message; `user_error` says which exceptions count as
the user's (a ValueError raised by our checks, an OSError about a file or an address the user gave, a
SystemExit carrying a message); `guarded` runs a command inside the boundary. Anything else is a bug of ours
and keeps its traceback. Shared checks: an output path that would clobber an input or cannot be written
(`check_output_path`, `write_atomically`), a memory budget beyond the device (`check_memory_mb`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

USER_ERRORS = (ValueError, OSError)


def one_line(message: object) -> str:
    """`message` as one line: its non-blank lines stripped and joined by a space."""
    text = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
    return text or type(message).__name__


def fail(prog: str, message: object) -> NoReturn:
    """Print "<prog>: error: <message>" as one line on stderr and exit with status 2."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(2)


def user_error(e: BaseException) -> str | None:
    """The one-line message of a user's mistake, or None when `e` is not one (a bug: let it propagate). An
    OSError is named by its file when it has one ("<file>: <reason>")."""
    if isinstance(e, OSError) and not isinstance(e, (BrokenPipeError, InterruptedError)):
        reason = e.strerror or str(e) or type(e).__name__
        where = e.filename if e.filename is not None else None
        return f"{where}: {reason}" if where is not None and str(where) not in reason else reason
    if isinstance(e, ValueError):
        return one_line(e)
    if isinstance(e, SystemExit) and isinstance(e.code, str):  # raise SystemExit("message")
        return one_line(e.code)
    return None


def guarded(prog: str, fn: Callable[[], int | None]) -> int:
    """fn() inside the boundary: its return value (None: 0), or 2 after one line on stderr for a user's
    mistake (the caller exits with it)."""
    try:
        return fn() or 0
    except (*USER_ERRORS, SystemExit) as e:
        message = user_error(e)
        if message is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return 2


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line ("<prog>: error: <message>", status 2), not the usage
    block and the message; its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def check_output_path(path: Path, flag: str, inputs: dict[str, Path | None]) -> None:
    """ValueError naming `flag` unless `path` can take the command's output without touching an input:
    not an existing directory, not the same file as any of `inputs` (flag -> path), and under a directory
    that exists or can be created and is writable (probed with a temporary file; nothing is left behind)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory (give a file path)")
    target = path.absolute()
    for name, other in inputs.items():
        if other is None:
            continue
        other = Path(other)
        same = target == other.absolute() or (path.exists() and other.exists() and os.path.samefile(path, other))
        if same:
            raise ValueError(f"{flag} {path}: is the input file of {name}; the output would overwrite it")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: cannot create its directory: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {parent}: {e.strerror or e}") from None


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory, renamed over it once complete
    (a reader never sees half a file); the temporary file is removed when anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # a plain new file's mode, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def device_memory_bytes(device: str) -> int | None:
    """The memory one engine on `device` can hold at most, for range checks at config time: the host's
    physical memory for "cpu" (os.sysconf: SC_PHYS_PAGES * SC_PAGE_SIZE), the GPU's total memory for "cuda"
    (device 0 for the family); None when it cannot be told (no such device, no sysconf)."""
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        index = torch.device(device).index or 0
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory_mb(value: float, device: str, name: str) -> None:
    """ValueError naming `name` when `value` MiB is more than `device` holds (`device_memory_bytes`)."""
    limit = device_memory_bytes(device)
    if limit is not None and value * 2**20 > limit:
        where = "this host's memory" if not str(device).startswith("cuda") else f"the GPU's memory ({device})"
        raise ValueError(f"{name} {value:g} MiB is more than {where}: {limit / 2**20:.0f} MiB")
