"""cluster.mode=disaggregated: the run's engines in processes of their own, which the launcher starts, watches
and restarts.

    miles-train recipe=k3_grpo cluster.mode=disaggregated cluster.engine_workers=2 rollout.backend=http \\
        rollout.max_staleness=1

`EngineFleet` starts `cluster.engine_workers` `miles-serve` processes on 127.0.0.1, each one engine replica in
the run's engine layout (`rollout.tp` ranks, `rollout.dcp`, `rollout.ep`: a GPU per rank on CUDA, after the
trainer's `cluster.num_workers`), serving the run's base as the colocated engine would (`serve_flags`). The
driver drives them through the HTTP backend (`miles_k3.trainer.http_engines.HTTPEngines`): prompt groups
dealt over them, each update a new adapter version, rollouts ahead of training with rollout.max_staleness. A
server that fails a request leaves the backend's set, its requests go to the others, and `restart` brings the
process back on the same address; the backend gives it the current adapter and takes it back into the set
(`rollout_servers_restarted`). `<run_dir>/engines.json` names each server's address and process id,
`<run_dir>/engine-<port>.log` holds its stderr. Nothing starts after `stop` (a revival racing the run's end).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from miles_k3.ranks import free_port
from miles_k3.trainer.resolve import ResolvedConfig

START_TIMEOUT_S = 300.0


def serve_flags(rc: ResolvedConfig) -> list[str]:
    """The run's engine as `miles-serve` flags (what `resolve.disaggregated_rules` lets a run set): its base
    and tokenizer, layout, dtype, MXFP4 mode, memory, a LoRA pool for the run's rank holding
    rollout.max_staleness + 2 versions (the next loads before the oldest kept one unloads), routing recording
    and speculation as the run asks."""
    r = rc.rollout
    flags = ["--model", str(rc.model.path), "--tokenizer", rc.model.tokenizer, "--device", rc.cluster.device]
    flags += ["--dtype", r.dtype, "--quantize", r.quantize, "--memory-mb", f"{r.memory_mb:g}"]
    flags += ["--max-running", str(r.max_running), "--max-prefill-tokens", str(r.max_prefill_tokens)]
    flags += ["--tp", str(r.tp), "--dcp", str(r.dcp)]
    flags += ["--max-lora-rank", str(rc.lora.rank), "--max-loras", str(r.max_staleness + 2)]
    flags += ["--host", "127.0.0.1", "--log-level", "warning"]
    if r.ep:
        flags.append("--ep")
    if r.record_routing:
        flags.append("--record-routing")
    if (spec := r.speculative).drafter is not None:
        flags += ["--speculative", "dspark", "--drafter", spec.drafter, "--gamma", str(spec.gamma)]
        flags += ["--spec-planner", spec.planner]
        if spec.max_batch is not None:
            flags += ["--spec-max-batch", str(spec.max_batch)]
    return flags


class EngineFleet:
    """The run's engine servers (module docstring). `start` blocks until every one serves; `restart(url)` is
    safe from any thread; `stop` ends them all (SIGTERM, then SIGKILL)."""

    def __init__(self, rc: ResolvedConfig, run_dir: str | Path):
        self.rc, self.run_dir = rc, Path(run_dir)
        self.flags = serve_flags(rc)
        self.lock = threading.Lock()
        self.procs: dict[str, subprocess.Popen] = {}  # url -> its process
        self.devices: dict[str, str | None] = {}  # url -> CUDA_VISIBLE_DEVICES of its ranks
        self.restarts = 0
        self.closed = False  # stop() was called: nothing starts after it

    def start(self) -> list[str]:
        c, r = self.rc.cluster, self.rc.rollout
        urls = []
        for i in range(c.engine_workers):
            devices = None
            if c.device == "cuda":
                first = c.num_workers + i * r.tp
                devices = ",".join(str(d) for d in range(first, first + r.tp))
            url = f"http://127.0.0.1:{free_port()}"
            self.devices[url] = devices
            urls.append(url)
        try:
            for url in urls:
                self._launch(url)
        except BaseException:
            self.stop()
            raise
        return urls

    def restart(self, url: str) -> None:
        """Start the server at `url` again (its process ended, or stopped answering: it is stopped first, so a
        sharded server's ranks end with it). ValueError once the fleet is stopping."""
        with self.lock:
            old = self.procs.get(url)
        if old is not None:
            _end(old)
        self._launch(url)
        with self.lock:
            self.restarts += 1

    def _launch(self, url: str) -> None:
        if self.closed:
            raise ValueError(f"the engine server at {url} is not started again: the run is ending")
        port = url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "rollout.server", *self.flags, "--port", port]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if (devices := self.devices[url]) is not None:  # indices into the GPUs this process sees
            seen = os.environ.get("CUDA_VISIBLE_DEVICES")
            if seen:
                visible = seen.split(",")
                devices = ",".join(visible[int(d)] for d in devices.split(","))
            env["CUDA_VISIBLE_DEVICES"] = devices
        if (threads := self.rc.cluster.threads_per_worker) is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        log = open(self.run_dir / f"engine-{port}.log", "a")  # noqa: SIM115 (the child writes it for its life)
        # in the run's process group: a signal to the job (Ctrl-C, the scheduler's) reaches the servers too
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.close()
        with self.lock:
            if self.closed:  # stop() ran while this one started
                proc.kill()
                proc.wait(timeout=60)
                raise ValueError(f"the engine server at {url} is not started again: the run is ending")
            self.procs[url] = proc
        line = _readline(proc, START_TIMEOUT_S)
        if not line.startswith("miles-serve: serving"):
            _end(proc)
            tail = (self.run_dir / f"engine-{port}.log").read_text().strip().splitlines()[-1:] or ["no output"]
            raise ValueError(f"cluster.engine_workers: the engine server at {url} did not start: {tail[0]}")
        threading.Thread(target=_drain, args=(proc,), daemon=True).start()  # later output never fills the pipe
        self._write_index()

    def _write_index(self) -> None:
        with self.lock:
            index = {url: p.pid for url, p in self.procs.items()}
        (self.run_dir / "engines.json").write_text(json.dumps(index, indent=1))

    def stop(self) -> None:
        with self.lock:
            self.closed = True
            procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # a sharded server passes it to its ranks
        deadline = time.monotonic() + 60
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=60)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM (a sharded server passes it to its ranks), then SIGKILL after a grace period."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=60)


def _drain(proc: subprocess.Popen) -> None:
    for _ in proc.stdout:
        pass


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """The process's first stdout line, or "" when it ends or `timeout_s` passes first."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0] if out else ""
