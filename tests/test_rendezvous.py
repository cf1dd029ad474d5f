"""A SLURM job's rendezvous: every rank derives one port from the job id, outside the range the host's outgoing
connections take their ports from, and a rank 0 that cannot bind it says which setting to change."""

from __future__ import annotations

import os
import socket

import pytest

from study.errors import StudyError
from study.train import distributed


@pytest.fixture
def environment():
    """The process environment as it was before the test: submitit's export writes the rendezvous variables
    straight into os.environ (a RANK left behind makes every later `study train` of this worker wait for peers)."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def slurm_task(environ, job_id: str, rank: int) -> None:
    """The variables `srun` gives task `rank` of a two-task, one-node job."""
    for key in [k for k in environ if k.startswith(("SLURM_", "SUBMITIT_"))] + [
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
        environ.pop(key, None)
    environ.update({"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": job_id, "SLURM_NTASKS": "2",
                    "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
                    "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_STEP_NODELIST": "vm"})


def test_every_rank_of_a_job_derives_one_port_below_the_ephemeral_range(environment):
    ports = {}
    for job_id in ("10", "11", "4000123"):
        for rank in (0, 1):
            slurm_task(environment, job_id, rank)
            assert distributed._export_slurm_env()
            assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == (str(rank), "2", "vm")
            ports.setdefault(job_id, set()).add(int(os.environ["MASTER_PORT"]))
    assert {job: len(p) for job, p in ports.items()} == {"10": 1, "11": 1, "4000123": 1}  # one port per job
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    for job_id, (port,) in ports.items():
        assert 20000 <= port < 32768 and not low <= port <= high, (job_id, port)
        assert port == 20000 + int(job_id) % 12768
    assert ports["10"] != ports["11"]
    slurm_task(environment, "10", 1)
    environment["MASTER_PORT"] = "29511"  # the user's choice (`cluster.setup`) is kept
    distributed._export_slurm_env()
    assert os.environ["MASTER_PORT"] == "29511"


def test_rank_0_that_cannot_bind_the_rendezvous_port_names_master_port(environment):
    from datetime import timedelta

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        with pytest.raises(StudyError) as err:
            distributed._job_store(0, 2, timedelta(seconds=5))
    finally:
        taken.close()
    assert err.value.field == "MASTER_PORT" and f"127.0.0.1:{port} (Address already in use)" in str(err.value)
