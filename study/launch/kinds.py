"""The kinds of job study submits, one word each (`JobKind`): what a job of that kind is given (`Resources`), what
it calls, and what one job works on (`Unit`): a kind is added here, in one place, whole. A kind's word is what a
person reads (`stage train: ...`), the end of its SLURM job name and the `stage` field of its job journal entries.
The submitit executor of a kind's jobs (`build_executor`) and the sbatch script a dry run shows are made here too."""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import replace
from enum import Enum, StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from study.config.cluster import ClusterConfig
from study.schema import submitit_dir

if TYPE_CHECKING:
    from study.plan.planner import Plan


class Resources(Enum):
    """What a job is given, from the cluster preset (the executor's resource class)."""

    layout = "the preset's layout"
    """The preset's nodes, tasks and GPUs: a run trains as the plan laid it out."""
    one_rank = "one rank"
    """One node, one task, at most one GPU: the geometry profile measures on one device."""
    preparation = "CPU only, preparation partition"
    """One CPU-only task with `cluster.prepare_cpus` on `cluster.prepare_partition` (else the preset's own): no GPU
    waits on tokenisation."""
    controller = "one CPU"
    """One CPU, no GPU, 4 GB, for as long as the preset lets a job run: a job that launches others."""

    def of(self, cluster: ClusterConfig) -> ClusterConfig:
        """The preset as a job given these resources sees it."""
        if self is Resources.one_rank:
            return replace(cluster, nodes=1, tasks_per_node=1, gpus_per_node=min(1, cluster.gpus_per_node))
        if self is Resources.controller:
            return replace(cluster, gpus_per_node=0, nodes=1, tasks_per_node=1, cpus_per_task=1, mem_gb=4)
        if self is Resources.preparation:
            return replace(cluster, nodes=1, tasks_per_node=1, gpus_per_node=0,
                           cpus_per_task=cluster.prepare_cpus or cluster.cpus_per_task,
                           partition=cluster.prepare_partition or cluster.partition)
        return cluster


class Unit(Enum):
    """What one job of a kind works on."""

    shards = "shard entry"
    """One shard entry (`study.jobs.prepare.DataGroup`): its journal key is the group's `prepare:<shards>`."""
    run = "run"
    """One run of the plan: its journal key is the kind's `prefix` and the run key."""
    experiment = "experiment"
    """The whole experiment: a controller that launches its runs."""


TRAIN_JOB = "study.launch.callables:TrainJob"
"""What a job that trains a run calls: every kind whose jobs call it trains (`JobKind.trains`)."""


class JobKind(StrEnum):
    """A kind of job: its word (the member's value), its resources, what it calls (`module:Class`, imported when a
    job is made, so reading a kind never imports submitit or torch) and its unit of work."""

    def __new__(cls, word: str, resources: Resources, calls: str, unit: Unit, prefix: str = ""):
        kind = str.__new__(cls, word)
        kind._value_ = word
        kind.resources, kind.calls, kind.unit, kind.prefix = resources, calls, unit, prefix
        return kind

    prepare = "prepare", Resources.preparation, "study.launch.callables:PrepareJob", Unit.shards
    """Tokenise a shard entry not yet in the cache, before any run reads it."""
    tune = "tune", Resources.layout, TRAIN_JOB, Unit.run
    """Train a point of an arm's tuning LR grid (a relaunch submits the main runs once they decide)."""
    train = "train", Resources.layout, TRAIN_JOB, Unit.run
    """Train a run (a trunk, a reference, an ordinary run), then evaluate it when `eval.after_train` is set."""
    branch = "branch", Resources.layout, TRAIN_JOB, Unit.run
    """Train a decay branch from its trunk's checkpoint: submitted held on SLURM until the trunk writes it, rung by
    rung locally (a race decides each rung before the next)."""
    profile = "profile", Resources.one_rank, "study.launch.callables:ProfileJob", Unit.run, "profile:"
    """Measure a finished reference run's geometry profile (journaled apart from the run's training)."""
    scheduled = "scheduled", Resources.layout, TRAIN_JOB, Unit.run
    """Train a run whose widths come from its reference's profile."""
    relaunch = "relaunch", Resources.controller, "study.launch.submit:RelaunchJob", Unit.experiment
    """Launch the experiment again once its tune runs end (SLURM; a local launch relaunches itself)."""
    until_decided = "until-decided", Resources.controller, "study.launch.adaptive:Adaptive", Unit.experiment
    """`study launch --until-decided`'s loop on SLURM: launches rounds of seeds until the comparisons decide."""
    calibrate = "calibrate", Resources.layout, TRAIN_JOB, Unit.run
    """Train a short copy of one shape to measure its throughput (`study calibrate`)."""

    resources: Resources
    calls: str
    unit: Unit
    prefix: str
    """Before a run key in the job journal's key of a job of this kind: a run's profile is journaled apart from its
    training."""

    @property
    def job(self) -> type:
        """The class a job of this kind calls (an instance is what submitit pickles and the job runs)."""
        module, _, name = self.calls.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def trains(self) -> bool:
        """Whether a job of this kind trains a run: it waits for its shards' preparation, the launch checks that it
        fits in memory, and a local launch asks before each batch whether something else took the run."""
        return self.calls == TRAIN_JOB


RUN_KINDS = tuple(k for k in JobKind if k.unit is Unit.run)
"""Kinds whose jobs belong to one run each (journal key `<prefix><run key>`); a tuple, so `in` answers for whatever
a damaged journal entry holds (a list), never a TypeError."""


def build_executor(cluster: ClusterConfig, folder: Path, name: str, kind: JobKind, preview: bool = False,
                   after: Sequence[str] = (), condition: str = "afterok", held: bool = False,
                   python: str | None = None):
    """The one way to build a submitit executor (every stage, the relaunch after tuning, `--until-decided`'s controller
    and `study calibrate`): its jobs are given the resources of their `kind` (`JobKind.resources`: the preset's
    layout, one rank for a profile, one CPU-only task for data preparation, one CPU for a controller). A `preview`
    one only writes the sbatch script a dry run shows, so it is built where SLURM is not installed (a laptop checking
    a cluster launch). On SLURM its jobs wait for the jobs `after` (`condition`: afterok, afterany), and are submitted
    `held` (`sbatch --hold`) when asked; local processes run in order and wait for nothing, each started by `python`
    when given (the launching process's warm server, `study.launch.warm.shared`), else by this interpreter."""
    import submitit

    cluster = kind.resources.of(cluster)
    if cluster.name == "local":
        ex = submitit.LocalExecutor(folder=str(folder), python=python)
        ex.update_parameters(timeout_min=cluster.time_min, tasks_per_node=cluster.tasks_per_node)
        return ex

    class Preview(submitit.SlurmExecutor):
        """submitit's SLURM executor as the dry run uses it: its sbatch writer, without submitit's check that srun
        exists (nothing is submitted)."""

        @classmethod
        def affinity(cls) -> int:
            return 1

    ex = (Preview if preview else submitit.SlurmExecutor)(folder=str(folder), max_num_timeout=cluster.max_requeues)
    tasks = cluster.gpus_per_node or cluster.tasks_per_node
    # what the preset leaves unset is left out (sbatch's defaults); submitit writes the flags sorted
    unless_unset = {"dependency": after and f"{condition}:" + ":".join(after), "gpus_per_node": cluster.gpus_per_node,
                    "mem": cluster.mem_gb and f"{cluster.mem_gb}GB",
                    **{key: getattr(cluster, key) for key in ("partition", "account", "qos", "constraint")}}
    ex.update_parameters(job_name=name, time=cluster.time_min, nodes=cluster.nodes, ntasks_per_node=tasks,
                         cpus_per_task=cluster.cpus_per_task, signal_delay_s=cluster.signal_delay_s,
                         array_parallelism=cluster.array_parallelism, setup=list(cluster.setup),
                         additional_parameters={"requeue": True, **({"hold": True} if held else {})},
                         **{key: value for key, value in unless_unset.items() if value})
    return ex


def job_name(text: str) -> str:
    """A SLURM job name (`<experiment>-<what its jobs do>`, mostly a job kind's word): anything but letters, digits,
    '_', '.' and '-' becomes '_'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def sbatch_preview(plan: Plan, kind: JobKind, count: int, after: list[str], held: bool = False,
                   cluster: ClusterConfig | None = None) -> str:
    """The sbatch script a stage's array of `count` jobs of `kind` would be submitted with (`--dry-run`; pinned by a
    golden file), on `cluster` (the stage's layout; the plan's first run's when not given)."""
    cfg = plan.runs[0].config
    folder = submitit_dir(cfg.paths.runs, cfg.experiment)
    ex = build_executor(cluster or cfg.cluster, folder, job_name(f"{cfg.experiment}-{kind}"), kind, preview=True,
                        after=after, held=held)
    from submitit.slurm.slurm import _make_sbatch_string

    # submitit's own writer, as submission uses it; `map_count` is how it writes the --array line
    params = {**ex.parameters, **({"map_count": count} if count > 1 else {})}
    return _make_sbatch_string(command="python -u -m submitit.core._submit '%j'", folder=ex.folder, **params)
