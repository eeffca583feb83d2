"""A throw-away Slurm cluster on this host for the tests: munged, slurmctld and two slurmd "nodes" (n1, n2:
distinct NodeName and port on the same machine), every file under one state directory.

`SlurmCluster.start()` writes slurm.conf, starts the daemons in the foreground as child processes of this
one (so their pids are ours) and waits until both nodes are idle; `stop()` ends exactly those pids (SIGTERM,
then SIGKILL after a grace period) and nothing else on the host. Clients (sbatch, squeue, scontrol) find the
cluster through SLURM_CONF, which `env()` sets; jobs inherit it (sbatch exports the environment).

`unavailable()` says why no cluster can start here (no Slurm binaries, not root), or None. scripts/setup.sh
installs the Debian packages where apt and root are available.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")


def unavailable() -> str | None:
    """Why a test cluster cannot start on this machine (None: it can)."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): scripts/setup.sh installs it where apt "
            f"and root are available"
        )
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root (slurmd starts jobs as their user)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


class SlurmCluster:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    # ------------------------------------------------------------------ set-up
    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        mem = max(256, _mem_mb() // 2)  # two "nodes" share the machine's memory
        ports = [_free_port() for _ in range(1 + len(NODES))]
        r = self.root
        lines = [
            "ClusterName=mk3test",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/munge.socket",
            f"SlurmctldPort={ports[0]}",
            f"StateSaveLocation={r}/ctld",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            # memory is consumable, as on most clusters: a second step of a job needs --overlap --mem=0
            "SelectTypeParameters=CR_Core_Memory",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "JobRequeue=1",
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "KillWait=20",
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
        ]
        for name, port in zip(NODES, ports[1:]):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
                f"RealMemory={mem} State=UNKNOWN"
            )
        lines.append(f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str], **kw) -> None:
        log = open(self.root / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True, **kw
        )

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        d = self.root / "munge"
        d.mkdir()
        d.chmod(0o755)  # munged: the socket's directory must be searchable by all (the key itself is 0600)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for p in (d, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        self._spawn(
            "munged",
            [
                _which("munged"),
                "-F",
                f"--socket={d}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ],
            user=munge.pw_uid,
            group=munge.pw_gid,
        )
        self._wait(lambda: (d / "munge.socket").exists(), "munged's socket", "munged")

    def start(self, timeout: float = 60) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged checks that the directories above its socket are not world-writable
        for sub in ("ctld", "spool"):
            (self.root / sub).mkdir()
        self._write_conf()
        self._start_munge()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for name in NODES:
            (self.root / "spool" / name).mkdir()
            self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
        self._wait(self._nodes_idle, "both nodes idle", "slurmctld", timeout)
        return self

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ready, what: str, daemon: str, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.time() > deadline:
                why = f"exited: {', '.join(dead)}" if dead else "timeout"
                raise RuntimeError(
                    f"test Slurm cluster: no {what} ({why}); see {self.root}/{daemon}.out and the logs beside it"
                )
            time.sleep(0.2)

    # --------------------------------------------------------------- tear-down
    def stop(self) -> None:
        """Cancel this cluster's jobs (a failed test may leave one running: its slurmstepd outlives slurmd),
        then end the daemons this object started (by pid), slurmd first, munged last."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.time() + 60
                while self.run("squeue", "-h", "-o", "%i", check=False).stdout.split() and time.time() < deadline:
                    time.sleep(0.5)
        for name in sorted(self.procs, key=lambda n: ("slurmd" not in n, n == "munged")):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
