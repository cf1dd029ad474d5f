"""Every kind of job study submits is whole: it has its resources, what its job calls, and its unit of work, and its
word is the one job journals already hold."""

from __future__ import annotations

import pytest

from study.config.cluster import ClusterConfig
from study.launch.kinds import RUN_KINDS, JobKind, Resources, Unit


@pytest.mark.parametrize("kind", list(JobKind))
def test_every_job_kind_has_resources_a_callable_job_and_a_unit(kind):
    assert isinstance(kind.resources, Resources) and isinstance(kind.unit, Unit)
    job = kind.job  # imported from its `module:Class`
    assert isinstance(job, type) and any("__call__" in vars(c) for c in job.__mro__ if c is not object), kind
    assert isinstance(kind.resources.of(ClusterConfig(name="h100", gpus_per_node=8)), ClusterConfig)


def test_job_kinds_call_the_jobs_and_get_the_resources_they_always_had():
    from study.launch.adaptive import Adaptive
    from study.launch.callables import PrepareJob, ProfileJob, TrainJob
    from study.launch.submit import RelaunchJob

    calls = {k: k.job for k in JobKind}
    assert calls == {JobKind.prepare: PrepareJob, JobKind.tune: TrainJob, JobKind.train: TrainJob,
                     JobKind.branch: TrainJob, JobKind.profile: ProfileJob, JobKind.scheduled: TrainJob,
                     JobKind.relaunch: RelaunchJob, JobKind.until_decided: Adaptive, JobKind.calibrate: TrainJob}
    assert {k for k in JobKind if k.trains} == {JobKind.tune, JobKind.train, JobKind.branch, JobKind.scheduled,
                                                JobKind.calibrate}
    h100 = ClusterConfig(name="h100", partition="gpu", nodes=2, gpus_per_node=8, cpus_per_task=12, mem_gb=0,
                         prepare_partition="cpu", prepare_cpus=32)

    def shape(kind: JobKind) -> tuple:
        c = kind.resources.of(h100)
        return c.nodes, c.gpus_per_node, c.tasks_per_node, c.cpus_per_task, c.mem_gb, c.partition

    assert {k: shape(k) for k in JobKind} == {
        JobKind.prepare: (1, 0, 1, 32, 0, "cpu"),  # CPU only, on the preparation partition
        JobKind.tune: (2, 8, 1, 12, 0, "gpu"), JobKind.train: (2, 8, 1, 12, 0, "gpu"),
        JobKind.branch: (2, 8, 1, 12, 0, "gpu"), JobKind.scheduled: (2, 8, 1, 12, 0, "gpu"),
        JobKind.calibrate: (2, 8, 1, 12, 0, "gpu"),
        JobKind.profile: (1, 1, 1, 12, 0, "gpu"),  # one rank
        JobKind.relaunch: (1, 0, 1, 1, 4, "gpu"), JobKind.until_decided: (1, 0, 1, 1, 4, "gpu"),  # one CPU
    }


def test_job_kind_words_are_those_job_journals_hold():
    """A journal written before the kinds were one enum is read the same: its `stage` words name the same kinds, and
    a run's jobs are told from the experiment's own."""
    assert [str(k) for k in JobKind] == ["prepare", "tune", "train", "branch", "profile", "scheduled", "relaunch",
                                         "until-decided", "calibrate"]
    assert {"tune", "train", "branch", "profile", "scheduled"} <= set(RUN_KINDS)
    assert not {"prepare", "relaunch"} & set(RUN_KINDS)
    assert [k.prefix for k in RUN_KINDS if k.prefix] == ["profile:"]
