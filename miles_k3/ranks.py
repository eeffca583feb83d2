"""Engine ranks as local processes, inside the commands' error boundary: `miles-k3 generate --tp` and
`miles-serve --tp` run one engine rank per spawned process (`spawn_ranks`). A rank that raises ends them all
(none is left waiting in a collective) and its error comes back to the parent as the boundary expects: a
user's mistake as one line naming the rank, a bug with its traceback (`miles_k3.errors`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

from miles_k3.errors import one_line, user_error

MEGATRON_NOTE = ".*Transformer Engine and Apex are not installed.*"  # what megatron warns on import


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (for spawning local multi-process worlds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_world() -> None:
    """End this process's torch.distributed world (if any) so that the process can exit cleanly.

    Why more than `destroy_process_group`: a gloo worker thread drops a finished collective's tensors after
    the caller's wait() returned, and with torch's PyObject-holding tensors that drop takes the GIL. If the
    main thread reaches interpreter finalization first, the thread is unwound while waiting for the GIL
    and the process aborts ("terminate called without an active exception", SIGABRT: a 2-rank generate
    whose last call is a broadcast hit it about 1 run in 3). Sleeping releases the GIL to those threads,
    which already wait for it, before the world is torn down and the process exits."""
    import torch.distributed as dist

    if dist.is_initialized():
        time.sleep(_GLOO_DRAIN_S)
        dist.destroy_process_group()


_GLOO_DRAIN_S = 0.05


def join_local_world(rank: int, world: int, port: int, device: str) -> str:
    """Rank `rank` of a `world`-process torch.distributed world on this host (rank 0 listening on `port`): gloo
    on CPU, nccl with one GPU per rank (`device` "cuda": this rank's GPU made current). Returns the rank's
    device. End it with `end_world`."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    return f"cuda:{rank}" if device == "cuda" else "cpu"


def spawn_ranks(
    fn: Callable[..., None], world: int, args: tuple, scratch: Path, *, signals_to_leader: bool = False
) -> None:
    """`fn(rank, world, *args)` in `world` spawned processes (`torch.multiprocessing.spawn`); returns once every
    rank has. A rank that raises ends them all (the others are terminated: none waits in a collective for
    it) and its error comes back here for the command's error boundary (`miles_k3.errors`), through
    `scratch/rank<R>.json`: a user's mistake (`user_error`: a ValueError, an OSError naming its file, ...) as
    ValueError("--tp rank R: <its one line>"), of the lowest rank that had one; a rank killed by SIGKILL (the
    OOM killer) as a ValueError saying so; anything else, a bug, as RuntimeError("--tp rank R: <type>:
    <message>") followed by that rank's traceback, of the rank that failed first (a rank's failure makes its
    peers fail after it, on a closed connection). The ranks print nothing of their own: megatron's
    import-time notes are silenced, and so are torch's notes on terminating the others.

    `signals_to_leader` (a server: it runs until stopped): SIGINT / SIGTERM to this process are sent on to rank
    0 as SIGTERM, and ranks > 0 ignore both (a terminal's Ctrl-C reaches every process of the group), so rank 0
    alone decides when the others stop (after its own shutdown: `Engine.stop_followers`)."""
    import torch.multiprocessing as mp

    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    before = {}
    try:
        context = mp.start_processes(
            _rank_main, args=(fn, world, str(scratch), args, signals_to_leader), nprocs=world, join=False
        )
        if signals_to_leader:
            leader = context.processes[0]

            def forward(signum, frame) -> None:
                if leader.is_alive():
                    os.kill(leader.pid, signal.SIGTERM)

            before = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        while not context.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise _rank_failure(scratch, e) from None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        spawn_log.setLevel(level)


def _rank_main(
    rank: int, fn: Callable[..., None], world: int, scratch: str, args: tuple, signals_to_leader: bool = False
) -> None:
    """One spawned rank of `spawn_ranks`: fn's exception recorded for the parent, then exit status 1."""
    warnings.filterwarnings("ignore", message=MEGATRON_NOTE)
    if signals_to_leader and rank > 0:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    try:
        fn(rank, world, *args)
    except Exception as e:
        message = user_error(e)
        record = {
            "time": time.monotonic(),
            "user": message is not None,
            "message": message if message is not None else f"{type(e).__name__}: {one_line(e)}",
            "traceback": traceback.format_exc(),
        }
        (Path(scratch) / f"rank{rank}.json").write_text(json.dumps(record))
        raise SystemExit(1) from None


def _rank_failure(scratch: Path, e: Exception) -> Exception:
    """The error `spawn_ranks` raises for the failed spawn `e`, from the ranks' records in `scratch`."""
    records = {int(p.stem[len("rank") :]): json.loads(p.read_text()) for p in scratch.glob("rank*.json")}
    users = sorted(rank for rank, record in records.items() if record["user"])
    if users:
        return ValueError(f"--tp rank {users[0]}: {records[users[0]]['message']}")
    if records:
        rank = min(records, key=lambda r: (records[r]["time"], r))
        return RuntimeError(f"--tp rank {rank}: {records[rank]['message']}\n{records[rank]['traceback']}")
    rank = getattr(e, "error_index", "?")
    if getattr(e, "signal_name", None) == "SIGKILL":
        return ValueError(
            f"--tp rank {rank} was killed (SIGKILL, most likely out of memory: each rank holds its --memory-mb "
            "of pools and its share of the weights)"
        )
    return RuntimeError(f"--tp rank {rank}: {one_line(e)}")
