"""Preemption: SIGTERM / SIGUSR1 become a request that the driver honours between steps.

Slurm signals a job before it takes the nodes away: SIGTERM at preemption, `scancel` and `scontrol requeue`
(SIGKILL follows after the cluster's KillWait), and, ahead of the time limit, the signal of
`#SBATCH --signal=B:USR1@<seconds>` (sent to the batch shell only; scripts/slurm/*.sbatch forward it to the
trainer). Python's default action for SIGTERM kills the process wherever it is, a checkpoint half written;
here the handler only records the signal. The driver (`GRPODriver.run`) finishes the step in flight, writes a
checkpoint (atomic, `miles_k3.trainer.checkpoint`) unless that step already wrote one, and returns; the
launcher then raises `Preempted`, whose exit status PREEMPTED_EXIT tells the batch file to requeue the job,
and the requeued job continues from that checkpoint (trainer.resume=auto).

Why 75: it is sysexits.h's EX_TEMPFAIL ("temporary failure, the user is invited to retry"): neither 0 (a
finished run, which must not be requeued) nor a failure status (1, 2 for a user's mistake, 128 + N for a
process killed by signal N, which requeueing would repeat forever). A cluster may also requeue it itself
with slurm.conf's `RequeueExit=75`.

What is safe when:
  watch()      once per process, around the whole run, from the main thread (Python lets only the main
               thread set handlers; elsewhere it logs that signals keep their default action). Every rank of
               a run watches: Slurm signals every process of the job, and a rank killed by the default action
               would break the collective the driver is in. Ranks other than the driver ignore the request
               (the driver tells them to stop after its checkpoint). On exit the previous handlers return.
  the handler  runs between two bytecodes of the main thread, maybe inside a logging call or a write: it
               only stores the signal's name (no I/O, no lock). A second signal changes nothing: the
               checkpoint in progress must not be cut short by an exception, and Slurm's SIGKILL follows
               anyway.
  requested()  anywhere, at any time: reads the stored name (None until a signal came).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: the batch files requeue the job on it
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: str | None = None


def _handler(signum: int, frame) -> None:
    global _received
    if _received is None:
        _received = signal.Signals(signum).name


def requested() -> str | None:
    """The name of the first preemption signal this process received inside `watch()`, or None."""
    return _received


@contextmanager
def watch(signals: tuple[signal.Signals, ...] = SIGNALS) -> Iterator[None]:
    """Record `signals` instead of dying of them, for the duration of the block (module docstring)."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        log.warning(
            "not in the main thread: %s keep their default action (no preemption checkpoint)",
            "/".join(s.name for s in signals),
        )
        yield
        return
    _received = None
    previous = {s: signal.signal(s, _handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Preempted(SystemExit):
    """The run stopped early on a preemption signal, after writing its checkpoint. A SystemExit whose code is
    PREEMPTED_EXIT: uncaught, the process exits with that status and no traceback."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(PREEMPTED_EXIT)
        self.signal_name, self.step = signal_name, step

    def __str__(self) -> str:
        return f"stopped on {self.signal_name} after step {self.step} (checkpoint written); requeue to continue"
