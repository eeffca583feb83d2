"""cluster.launcher=external: a rank's place from srun's or torchrun's environment, and the config errors
that name what is missing before any model is built."""

import pytest

from miles_k3.trainer.config import ClusterCfg, Rendezvous, first_host, rendezvous_from_env

SRUN = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


@pytest.mark.parametrize(
    "nodelist, first",
    [("n1", "n1"), ("gpu[07-09,12],cpu3", "gpu07"), ("a,b", "a"), ("node-[001-004]-ib", "node-001-ib"), ("x[3]", "x3")],
)
def test_first_host_of_a_slurm_hostlist(nodelist, first):
    assert first_host(nodelist) == first


def test_srun_rank_and_rank_zero_on_the_first_node():
    r = rendezvous_from_env(SRUN)
    assert r == Rendezvous(rank=3, world_size=4, local_rank=1, master_addr="gpu07", master_port=20000 + 123456 % 20000)
    assert r.init_method == f"tcp://gpu07:{r.master_port}"
    # the batch file's MASTER_ADDR / MASTER_PORT win (the node's address, not its name)
    r = rendezvous_from_env({**SRUN, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"})
    assert (r.master_addr, r.master_port) == ("10.0.0.7", 29500)


def test_torchrun_variables_take_precedence_over_sruns():
    env = {**SRUN, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert rendezvous_from_env(env) == Rendezvous(0, 2, 0, "h", 1)


def test_outside_a_launched_world_names_the_variables():
    with pytest.raises(ValueError, match="cluster.launcher 'external'.*missing SLURM_PROCID"):
        rendezvous_from_env({})


def test_num_workers_must_match_the_world_the_launcher_started(monkeypatch):
    for k, v in SRUN.items():
        monkeypatch.setenv(k, v)
    ClusterCfg(launcher="external", num_workers=4).check()
    with pytest.raises(ValueError, match=r"num_workers must equal the world the launcher started \(4 processes\)"):
        ClusterCfg(launcher="external", num_workers=2).check()
