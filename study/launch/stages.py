"""A launch's stages: which runs and shard entries still need a job (asked of the job journal and the schedulers
once, `Queue`), what each stage waits for, and submitting one stage as a job array (or local processes)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from study.config.spec import RunSpec
from study.jobs.prepare import PREPARE, DataGroup, missing_groups, shards_id
from study.errors import StudyError
from study.launch.executor import _executor, _safe_name
from study.launch.scheduler import ACTIVE, STUCK, active, job_states, journal, outside_allocation, record
from study.plan.planner import Plan
from study.schema import submitit_dir
from study.track.query import status_by_key
from study.train.lease import held_by

RUN_STAGES = ("tune", "train", "profile", "scheduled")
"""Stages whose jobs belong to one run each (journal key `<run key>`, or `profile:<run key>`)."""


@dataclass
class Stage:
    name: str
    """`prepare`, `tune`, `train`, `profile` or `scheduled`."""
    runs: list[RunSpec]
    """Runs (for `profile`, the reference runs to profile; for `prepare`, one run per shard entry to tokenise)."""
    after: list[str] = field(default_factory=list)
    """Job ids this stage waits for (afterok)."""
    job_ids: list[str] = field(default_factory=list)
    """Filled on submission."""
    groups: list[DataGroup] = field(default_factory=list)
    """For `prepare`: the shard entries to tokenise, one job each (aligned with `runs`)."""

    def keys(self) -> list[str]:
        """The job journal's name of each job of the stage."""
        if self.name == "prepare":
            return [g.key for g in self.groups]
        return [("profile:" if self.name == "profile" else "") + r.key for r in self.runs]


def runs_root(plan: Plan) -> str:
    return plan.runs[0].config.paths.runs


class Queue:
    """The experiment's job journal and what the schedulers say of its jobs now, read once."""

    def __init__(self, plan: Plan):
        self.jobs = journal(runs_root(plan), plan.experiment.name)
        self.states = job_states(self.jobs)
        self.on_slurm = plan.runs[0].config.cluster.name != "local"
        self.planned = {r.key for r in plan.runs}
        self.elsewhere: dict[str, tuple[str, str]] = {}
        """(name, why) per key `busy` found taken outside this launch's own SLURM queue: the launch says so."""

    def busy(self, key: str, run: RunSpec | None = None) -> bool:
        """The key's latest job may still run (a SLURM job queued or running, a local job's live process), or, for a
        run, a live process holds its run directory's lease (a local launch, `study train`, a job this journal does
        not know)."""
        entry = self.jobs.get(key)
        if entry is not None and active(entry, self.states):
            name = entry.get("name", key)
            if entry.get("scheduler") != "slurm":
                self.elsewhere[key] = name, f"local process {entry['job_id']} on {entry['host']} runs it"
            elif not self.on_slurm:  # a SLURM relaunch passes over its own queue silently: that is its idempotence
                self.elsewhere[key] = name, f"SLURM job {entry['job_id']} is {self.states[entry['job_id']]}"
            return True
        holder = held_by(run.run_dir.path) if run is not None else None
        if holder is not None:
            self.elsewhere[key] = run.name, f"a live process ({holder}) holds its run directory's lease"
        return holder is not None

    def live(self) -> dict[str, str]:
        """SLURM job id per key whose job is queued or running: what new jobs wait for (afterok). A finished job
        needs no waiting for, sbatch refuses a dependency on a job SLURM has forgotten, and one on a failed or
        cancelled job would never be satisfied."""
        return {k: e["job_id"] for k, e in self.jobs.items()
                if e.get("scheduler") == "slurm" and self.states.get(e["job_id"]) in ACTIVE}

    def stale(self) -> tuple[list[dict], list[dict], list[dict]]:
        """SLURM jobs a launch acts on: (queued jobs of runs the plan no longer has, which it cancels; running jobs of
        such runs, which it names; jobs that can never start, which it cancels and submits again)."""
        superseded, running, stuck = [], [], []
        for e in self.jobs.values():
            state = self.states.get(e["job_id"]) if e.get("scheduler") == "slurm" else None
            gone = e.get("stage") in RUN_STAGES and e["key"].removeprefix("profile:") not in self.planned
            if gone and state in ("PENDING", STUCK):
                superseded.append(e)
            elif gone and state in ACTIVE:
                running.append(e)
            elif state == STUCK:
                stuck.append(e)
        return superseded, running, stuck


def to_submit(plan: Plan, queue: Queue) -> tuple[list[DataGroup], list[RunSpec], list[RunSpec], list[RunSpec]]:
    """(shard entries to prepare, train runs, references to profile, scheduled runs) that still need a job."""
    cfg0 = plan.runs[0].config
    status = status_by_key(plan.experiment.name, cfg0.tracking.uri)
    busy = queue.busy

    def done(r: RunSpec) -> bool:
        """Trained, and evaluated when it is to be: a run whose evaluation failed is submitted again (training
        resumes at its last checkpoint, so only the evaluation runs)."""
        if status.get(r.key) != "FINISHED":
            return False
        from study.evaluate.records import evaluated

        return not r.config.eval.after_train or evaluated(r)

    tune = [r for r in plan.runs if r.stage == "tune" and not done(r) and not busy(r.key, r)]
    # a main run whose LR waits for its tuning is submitted by the launch that finds the tuning decided
    ready = [r for r in plan.runs if not r.awaits_tuning]
    train = tune + [r for r in ready if r.stage not in ("scheduled", "tune") and not done(r) and not busy(r.key, r)]
    refs = {d for r in ready if r.stage == "scheduled" for d in r.depends_on}
    profile = [r for r in plan.runs if r.key in refs and not r.run_dir.profile.is_file()
               and not busy(f"profile:{r.key}")]
    scheduled = [r for r in ready if r.stage == "scheduled" and not done(r) and not busy(r.key, r)]
    prepare = [g for g in missing_groups(train + scheduled) if not busy(g.key)]
    return prepare, train, profile, scheduled


def submit_stage(plan: Plan, stage: Stage) -> list:
    from study.launch.callables import PrepareJob, ProfileJob, TrainJob

    cfg = plan.runs[0].config
    folder = submitit_dir(cfg.paths.runs, cfg.experiment) / "%j"
    ex = _executor(cfg.cluster, folder, _safe_name(f"{cfg.experiment}-{stage.name}"), stage.name)
    if stage.after and cfg.cluster.name != "local":
        ex.update_parameters(dependency="afterok:" + ":".join(stage.after))
    if stage.name == "prepare":
        callables = [PrepareJob(g.runs[0].dir, g.model_vocab) for g in stage.groups]
    else:
        make = ProfileJob if stage.name == "profile" else TrainJob
        callables = [make(r.dir) for r in stage.runs]
    try:
        with outside_allocation():
            jobs = _submit_array(ex, callables)
    except Exception as err:  # sbatch's own message is the useful part
        raise StudyError("cluster", f"submission of the {stage.name} stage failed: {err}",
                         "check the cluster profile (partition, account, qos, time limit) against `sinfo`") from None
    ids = [j.job_id for j in jobs]
    scheduler = "local" if cfg.cluster.name == "local" else "slurm"
    names = [g.data.name for g in stage.groups] if stage.name == "prepare" else [r.name for r in stage.runs]
    record(runs_root(plan), plan.experiment.name, [{"key": k, "job_id": j, "stage": stage.name, "scheduler": scheduler,
                   "name": n, "after": stage.after, "host": socket.gethostname(), "time": time.time()}
                  for k, n, j in zip(stage.keys(), names, ids)])
    stage.job_ids = ids
    return jobs


def _submit_array(ex, callables: list) -> list:
    with ex.batch():
        jobs = [ex.submit(c) for c in callables]
    return jobs


def plan_stages(plan: Plan, queue: Queue) -> list[Stage]:
    """The stages still to submit, with their dependencies on jobs submitted now or still active."""
    prepare, train, profile, scheduled = to_submit(plan, queue)
    submitted = queue.live()
    stages = []
    if prepare:
        stages.append(Stage("prepare", [g.runs[0] for g in prepare], groups=prepare))
    tune = [r for r in train if r.stage == "tune"]
    if tune:
        stages.append(Stage("tune", tune))
    train = [r for r in train if r.stage != "tune"]
    if train:
        stages.append(Stage("train", train))
    if profile:
        stages.append(Stage("profile", profile))
    if scheduled:
        stages.append(Stage("scheduled", scheduled))
    for stage in stages:
        stage.after = dependencies(stage, submitted)
    return stages


def dependencies(stage: Stage, submitted: dict[str, str]) -> list[str]:
    """Exactly the upstream array tasks of a stage's runs (a reference run, its profile), not whole arrays."""
    return sorted({submitted[k] for r in stage.runs for k in _upstream(stage.name, r) if k in submitted})


def _upstream(stage: str, run: RunSpec) -> list[str]:
    data = PREPARE + shards_id(run.config.data)
    if stage == "profile":
        return [run.key]
    if stage == "scheduled":
        return [f"profile:{k}" for k in run.depends_on] + [data]
    if stage in ("train", "tune"):
        return [data]
    return []


def say_skipped(queue: Queue, echo) -> None:
    for key, (name, why) in queue.elsewhere.items():
        echo(f"skipped {name} ({key}): {why}; it is not submitted twice")


def stage_lines(stage: Stage) -> list[str]:
    if stage.name == "prepare":
        return [f"{g.data.name} for {len(g.runs)} run{'s' * (len(g.runs) != 1)}" for g in stage.groups]
    return [f"{r.key}  {r.name}" for r in stage.runs]
