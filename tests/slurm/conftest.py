"""The test Slurm cluster (tests/slurm/cluster.py), started once for the session by the first test that
asks for it and stopped at the end: only the daemons it started, by pid. Where Slurm cannot run (not
installed: scripts/setup.sh installs it with apt as root; not root) every test that needs it is skipped,
naming the reason."""

import os
import shutil
import tempfile

import pytest

from tests.slurm.cluster import SlurmCluster, unavailable


@pytest.fixture(scope="session")
def slurm():
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no test Slurm cluster: {reason}")
    # not under pytest's 0700 temporary directory: munged (its own user) must reach its socket's directory
    root = tempfile.mkdtemp(prefix="miles-k3-slurm-")
    os.chmod(root, 0o755)
    cluster = SlurmCluster(os.path.join(root, "cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
