"""A launch's stages: which runs and shard entries still need a job (asked of the job journal and the schedulers
once, `Queue`), what each stage waits for, and submitting one stage as a job array (or local processes). A stage is
a phase of a launch: jobs of one kind (study.launch.kinds) waiting on jobs of earlier stages or launches."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from study.config.run import Role
from study.config.spec import RunSpec
from study.data.shards import find_shards
from study.jobs.prepare import PREPARE, DataGroup, data_groups, shards_id
from study.errors import StudyError
from study.launch.branching import branch_ready
from study.launch.kinds import RUN_KINDS, JobKind, Unit, build_executor, job_name
from study.launch.racing import stopped_keys
from study.launch.run_state import JOB_DOES, QUEUED, RUNNING, SLURM, Sources, Worker, state_of, worker_of
from study.launch.scheduler import ACTIVE, STUCK, outside_allocation, record
from study.plan.planner import Plan
from study.schema import submitit_dir


@dataclass
class Stage:
    """A phase of a launch: jobs of one kind, one per run (or shard entry), submitted together as one job array."""

    kind: JobKind
    """What each job of the stage does: `prepare`, `tune`, `train`, `branch`, `profile` or `scheduled`."""
    runs: list[RunSpec]
    """Runs (for `profile`, the reference runs to profile; for `prepare`, one run per shard entry to tokenise)."""
    after: list[str] = field(default_factory=list)
    """Job ids this stage waits for (afterok)."""
    job_ids: list[str] = field(default_factory=list)
    """Filled on submission."""
    groups: list[DataGroup] = field(default_factory=list)
    """For `prepare`: the shard entries to tokenise, one job each (aligned with `runs`)."""
    held: bool = False
    """For `branch`: submitted held (`sbatch --hold`) until their trunks write their starts (study.launch.branching)."""

    @property
    def name(self) -> str:
        """What a person reads for the stage (`stage train: ...`): its kind's word."""
        return self.kind.value

    @property
    def on_shards(self) -> bool:
        """Its jobs tokenise shard entries (`groups`), not runs."""
        return self.kind.unit is Unit.shards

    def keys(self) -> list[str]:
        """The job journal's name of each job of the stage."""
        if self.on_shards:
            return [g.key for g in self.groups]
        return [self.kind.prefix + r.key for r in self.runs]


def runs_root(plan: Plan) -> str:
    return plan.runs[0].config.paths.runs


class Queue(Sources):
    """The experiment's `Sources`, and what a launch says of the runs it passes over."""

    def __init__(self, plan: Plan):
        super().__init__(runs_root(plan), plan.experiment.name, plan.runs[0].config.tracking.uri, plan.overrides)
        self.on_slurm = plan.runs[0].config.cluster.name != "local"
        self.planned = {r.key for r in plan.runs}
        self.elsewhere: dict[str, tuple[str, str]] = {}
        """(name, why) per key found taken outside this launch's own SLURM queue."""
        self.disagree: dict[str, tuple[str, str]] = {}
        """(name, MLflow's disagreement and what the run's job does) per run submitted against MLflow's word."""
        self.blocked: dict[str, tuple[str, str]] = {}
        """(name, why and the repair) per run no job can train (`RunState.blocked`), so not submitted."""

    def busy(self, key: str, run: RunSpec | None = None) -> bool:
        """The key's latest job may still run or, for a run, a live process holds its lease (`worker_of`)."""
        return self.taken(key, run.name if run else self.jobs.get(key, {}).get("name", key),
                          worker_of(run, self) if run is not None else self.job(key))

    def taken(self, key: str, name: str, worker: Worker) -> bool:
        """Whether `worker` takes the key, noting who unless it is this launch's own SLURM queue (which a SLURM
        relaunch passes over silently: that is its idempotence)."""
        if worker.what not in (RUNNING, QUEUED):
            return False
        if worker.source != SLURM or not self.on_slurm:
            self.elsewhere[key] = name, worker.by
        return True

    def wanted(self, run: RunSpec) -> bool:
        """Whether a launch submits the run: its state needs something and nothing works on it."""
        state = state_of(run, self)
        if state.done or self.taken(run.key, run.name, state.worker) or self._blocked(run, state.blocked):
            return False
        if state.disagreement:
            self.disagree[run.key] = run.name, f"{state.disagreement}; the run directory wins: {JOB_DOES[state.needs]}"
        return True

    def dead_end(self, run: RunSpec) -> bool:
        """Whether no job can train the run now (a local launch asks before each batch of branches)."""
        return self._blocked(run, state_of(run, self).blocked)

    def _blocked(self, run: RunSpec, why: str) -> bool:
        if why:
            self.blocked[run.key] = run.name, why
        return bool(why)

    def live(self) -> dict[str, str]:
        """SLURM job id per key whose job is queued or running: what new jobs wait for (afterok). A finished job
        needs no waiting for, and a dependency on a forgotten, failed or cancelled one would never be satisfied."""
        return {k: e["job_id"] for k, e in self.jobs.items()
                if e.get("scheduler") == "slurm" and self.states.get(e["job_id"]) in ACTIVE}

    def stale(self) -> tuple[list[dict], list[dict], list[dict]]:
        """SLURM jobs a launch acts on: (queued jobs of runs the plan no longer has, which it cancels; running jobs of
        such runs, which it names; jobs that can never start, which it cancels and submits again)."""
        superseded, running, stuck = [], [], []
        for e in self.jobs.values():
            state = self.states.get(e["job_id"]) if e.get("scheduler") == "slurm" else None
            # an entry's `stage` is the word of its job's kind
            gone = e.get("stage") in RUN_KINDS and e["key"].removeprefix(JobKind(e["stage"]).prefix) not in self.planned
            if gone and state in ("PENDING", STUCK):
                superseded.append(e)
            elif gone and state in ACTIVE:
                running.append(e)
            elif state == STUCK:
                stuck.append(e)
        return superseded, running, stuck


def to_submit(plan: Plan, queue: Queue) -> tuple[list[DataGroup], list[RunSpec], list[RunSpec], list[RunSpec]]:
    """(shard entries to prepare, train runs, references to profile, scheduled runs) that still need a job (`wanted`),
    leaving out the arms the race stopped."""
    stopped = stopped_keys(plan)

    def wanted(run: RunSpec) -> bool:
        return run.key not in stopped and queue.wanted(run)

    tune = [r for r in plan.runs if r.role == Role.tune and wanted(r)]
    # a main run whose LR waits for its tuning is submitted by the launch that finds the tuning decided
    ready = [r for r in plan.runs if not r.awaits_tuning]
    train = tune + [r for r in ready if r.role not in (Role.scheduled, Role.tune) and wanted(r)]
    refs = {d for r in ready if r.role == Role.scheduled for d in r.depends_on}
    profile = [r for r in plan.runs if r.key in refs and not r.run_dir.profile.is_file()
               and not queue.busy(JobKind.profile.prefix + r.key)]
    scheduled = [r for r in ready if r.role == Role.scheduled and wanted(r)]
    prepare = [g for g in data_groups(train + scheduled) if find_shards(g.data) is None and not queue.busy(g.key)]
    return prepare, train, profile, scheduled


def submit_stage(plan: Plan, stage: Stage, python: str | None = None) -> list:
    cfg = plan.runs[0].config
    folder = submitit_dir(cfg.paths.runs, cfg.experiment) / "%j"
    ex = build_executor(stage.runs[0].config.cluster, folder, job_name(f"{cfg.experiment}-{stage.name}"), stage.kind,
                        after=stage.after, held=stage.held, python=python)
    make = stage.kind.job
    callables = ([make(g.runs[0].dir, g.model_vocab) for g in stage.groups] if stage.on_shards
                 else [make(r.dir) for r in stage.runs])
    try:
        with outside_allocation(), ex.batch():
            jobs = [ex.submit(c) for c in callables]
    except Exception as err:  # sbatch's own message is the useful part
        raise StudyError("cluster", f"submission of the {stage.name} stage failed: {err}",
                         "check the cluster preset (partition, account, qos, time limit) against `sinfo`") from None
    ids = [j.job_id for j in jobs]
    scheduler = "local" if cfg.cluster.name == "local" else "slurm"
    names = [g.data.name for g in stage.groups] if stage.on_shards else [r.name for r in stage.runs]
    record(runs_root(plan), plan.experiment.name, [{"key": k, "job_id": j, "stage": stage.name, "scheduler": scheduler,
                   "name": n, "after": stage.after, "host": socket.gethostname(), "time": time.time()}
                  for k, n, j in zip(stage.keys(), names, ids)])
    stage.job_ids = ids
    return jobs


def plan_stages(plan: Plan, queue: Queue) -> list[Stage]:
    """The stages still to submit, with their dependencies on jobs submitted now or still active."""
    prepare, train, profile, scheduled = to_submit(plan, queue)
    submitted = queue.live()
    # rung by rung: a local launch decides each rung before it trains the next
    branches = sorted((r for r in train if r.role == Role.branch), key=lambda r: r.points[0].at)
    # on SLURM a branch whose trunk has not written its start waits, held, for the trunk's job; locally trunks run first
    held = {r.key for r in branches if queue.on_slurm and not branch_ready(r)}
    stages = [Stage(JobKind.prepare, [g.runs[0] for g in prepare], groups=prepare),
              Stage(JobKind.tune, [r for r in train if r.role == Role.tune]),
              Stage(JobKind.train, [r for r in train if r.role not in (Role.tune, Role.branch)]),
              Stage(JobKind.branch, [r for r in branches if r.key not in held]),
              Stage(JobKind.branch, [r for r in branches if r.key in held], held=True),
              Stage(JobKind.profile, profile), Stage(JobKind.scheduled, scheduled)]
    stages = [part for stage in stages for part in by_layout(stage)]  # an empty stage has no part
    for stage in stages:
        stage.after = dependencies(stage, submitted)
    return stages


def by_layout(stage: Stage) -> list[Stage]:
    """The stage as one array per cluster layout its runs ask for: an experiment's `at:` may give each scale its own
    (`cluster.nodes: 8` at 8B), and one array's jobs share one sbatch header. Runs keep their order within each."""
    parts: dict[str, Stage] = {}
    for i, run in enumerate(stage.runs):
        part = parts.setdefault(repr(run.config.cluster), Stage(stage.kind, [], held=stage.held))
        part.runs.append(run)
        if stage.on_shards:
            part.groups.append(stage.groups[i])
    return list(parts.values())


def dependencies(stage: Stage, submitted: dict[str, str]) -> list[str]:
    """Exactly the upstream array tasks of a stage's runs (a reference run, its profile), not whole arrays."""
    return sorted({submitted[k] for r in stage.runs for k in _upstream(stage.kind, r) if k in submitted})


def _upstream(kind: JobKind, run: RunSpec) -> list[str]:
    """The journal keys of the jobs a job of `kind` for `run` waits for: a profile its reference run's training; a
    training job the preparation of its shards, and a scheduled run besides its references' profiles."""
    if kind is JobKind.profile:
        return [run.key]
    profiles = [JobKind.profile.prefix + k for k in run.depends_on] if kind is JobKind.scheduled else []
    return profiles + ([PREPARE + shards_id(run.config.data)] if kind.trains else [])


def say_skipped(queue: Queue, echo) -> None:
    """Name each run passed over because something else works on it, each submitted against MLflow's word, and each
    no job can train, with its repair."""
    for found, line in ((queue.elsewhere, "skipped {} ({}): {}; it is not submitted twice"),
                        (queue.disagree, "{} ({}): {}"), (queue.blocked, "not submitted: {} ({}): {}")):
        for key, (name, why) in found.items():
            echo(line.format(name, key, why))


def stage_lines(stage: Stage) -> list[str]:
    if stage.on_shards:
        return [f"{g.data.name} for {len(g.runs)} run{'s' * (len(g.runs) != 1)}" for g in stage.groups]
    return [f"{r.key}  {r.name}" for r in stage.runs]
