"""How `miles-serve` starts its engine and server: in this process (`start`, then `serve`), or as one rank of
`--tp` N processes (`serve_rank`, spawned by `miles_k3.ranks.spawn_ranks`: rank 0 serves, the others replay its
engine calls until it stops); `local_servers` starts several miles-serve processes for the RL loop's HTTP
backend on one machine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from miles_k3.errors import user_error
from rollout.server.config import ServeConfig


def start(cfg: ServeConfig, device: str | None = None):
    """(served, server): the model, tokenizer and adapters the flags name, and the server bound to its address
    (not yet serving). `device`: a sharded engine rank's own device."""
    from rollout.server.app import Server  # after the flags parse: --help stays fast
    from rollout.server.loading import load_served

    try:
        served = load_served(cfg, device)
    except OSError as e:  # a file the flags name that cannot be read
        raise ValueError(user_error(e)) from None
    try:
        return served, Server(
            served,
            max_queued=cfg.max_queued,
            host=cfg.host,
            port=cfg.port,
            shutdown_timeout=cfg.shutdown_timeout,
            log_level=cfg.log_level,
        )
    except OSError as e:  # the address is taken, or cannot be bound
        raise ValueError(f"--host {cfg.host} --port {cfg.port}: cannot listen: {user_error(e)}") from None


def serve(served, server) -> None:
    print(
        f"miles-serve: serving {served.model_name} (adapters: {list(served.adapters) or 'none'}) on {server.url}",
        flush=True,
    )
    server.run()
    print("miles-serve: stopped", flush=True)


def serve_rank(rank: int, world: int, port: int, cfg: ServeConfig) -> None:
    """One engine rank of `miles-serve --tp` (`miles_k3.ranks.spawn_ranks`): rank 0 builds the engine's leader
    and serves it until stopped, then releases the others, which replay its engine calls (`Engine.follow`)."""
    from miles_k3.ranks import end_world, join_local_world
    from rollout.build import build_engine

    device = join_local_world(rank, world, port, cfg.device)
    try:
        if rank > 0:
            build_engine(cfg.engine_spec(device=device)).follow()
            return
        served, server = start(cfg, device)
        try:
            serve(served, server)
        finally:
            served.engine.stop_followers()
    finally:
        end_world()


@contextlib.contextmanager
def local_servers(n: int, flags: list[str], *, cwd: str | None = None) -> Iterator[tuple[list, list[str]]]:
    """`n` `miles-serve` processes on 127.0.0.1 with `flags` (a free port each): (their Popen objects, their base
    URLs) once every one serves; each is stopped with SIGTERM (and waited for) on exit. For the RL loop's HTTP
    backend on one machine (`rollout.backend=http`), its tests and benchmarks."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    cmd = [sys.executable, "-m", "rollout.server", "--port", "0", *flags]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(n)]  # each server's stderr, for its failure
    procs = [subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True, env=env) for log in logs]
    try:
        urls = []
        for p, log in zip(procs, logs):
            line = p.stdout.readline()
            if not line.startswith("miles-serve: serving"):
                p.wait(timeout=60)
                log.seek(0)
                raise RuntimeError(f"miles-serve {' '.join(flags)} did not start: {log.read()[-1000:]}")
            urls.append(line.rsplit(" ", 1)[-1].strip())
        yield procs, urls
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, log in zip(procs, logs):
            p.wait(timeout=60)
            log.close()
