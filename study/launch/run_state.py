"""What a run still needs, in one answer (:func:`state_of`): nothing, its evaluation of record, training, or MLflow's
copy of its result; and whether something already works on it (running, queued, or stuck).

Each fact has one source: the run directory says what is done (`result.json`, the evaluation records under `evals/`)
and who trains the run now (a live process holds its lease); the scheduler (the job journal, SLURM) says what is
queued, running or can never start. MLflow mirrors the run directory: where they disagree the run directory wins and
the disagreement is named. `study launch`, `study status` and `--until-decided` all ask here, so they cannot answer
differently. A run no job can train (a dead end: its job would fail the same way at every launch) is never submitted,
and its answer names the one command that repairs it."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from study.config.run import Role
from study.config.secrets import redact
from study.config.spec import RunSpec, diverged
from study.eval.records import evaluated, final_step
from study.launch.branching import branch_ready, trunk_past
from study.launch.scheduler import ACTIVE, STUCK as NEVER_STARTS, job_states, journal, local_alive
from study.schema import TAG_FAILURE_REASON
from study.track.query import runs_by_key
from study.train.checkpoint import at_step, latest
from study.train.lease import held_by

# What a run still needs
NOTHING = "nothing"
"""Trained, and evaluated when it is to be, and MLflow holds it FINISHED."""
EVALUATION = "evaluation"
"""Trained, but its evaluation of record (`eval.after_train`) is missing: its job evaluates the final checkpoint."""
TRAINING = "training"
"""Not trained: its run directory holds no result.json of its key."""
MIRROR = "mirror"
"""Done as its run directory says, but MLflow does not hold it FINISHED (a store swapped, emptied, or unreachable when
the run closed): its job resumes at the final checkpoint and brings MLflow every point."""

JOB_DOES = {TRAINING: "its job trains it", EVALUATION: "its job evaluates its final checkpoint",
            MIRROR: "its job brings MLflow the result", NOTHING: "it needs no job"}
"""What a launch's job does for a run, by what the run needs (its job always resumes at the latest checkpoint)."""

# What already works on it
RUNNING, QUEUED, STUCK = "running", "queued", "stuck"
"""A job or process trains it now; a SLURM job waits to start; a SLURM job can never start (a job it waits for
failed or was cancelled), so a launch cancels it and submits the run again."""
SLURM, LOCAL, LEASE = "slurm", "local", "lease"
"""Who said so: SLURM of a journal's job, the live process of a local launch's job, the run directory's lease."""


@dataclass(frozen=True)
class Worker:
    """What works on a key now, as the scheduler or the run directory says."""

    what: str | None
    """RUNNING, QUEUED, STUCK, or None when nothing does."""
    by: str = ""
    """Who, in words: `SLURM job 12_0 is PENDING`, `local process 4242 on host runs it`, ..."""
    source: str = ""
    """SLURM, LOCAL or LEASE."""


NOBODY = Worker(None)


@dataclass(frozen=True)
class RunState:
    """The one answer for a run: what it still needs and what works on it."""

    key: str
    needs: str
    """NOTHING, EVALUATION, TRAINING or MIRROR."""
    worker: Worker
    mlflow: str
    """MLflow's status of the run (`-` when MLflow holds no run of its key): a mirror, never the answer."""
    disagreement: str = ""
    """Where MLflow says otherwise than the run directory, in words (the run directory wins); empty when they agree."""
    diverged: bool = False
    """A tune run settled by diverging: its result is that its LR is too high (MLflow holds it FAILED)."""
    blocked: str = ""
    """Why no job can give the run what it needs, with the one command that repairs it; empty when its job can."""

    @property
    def done(self) -> bool:
        return self.needs == NOTHING


class Sources:
    """What the scheduler says of an experiment's jobs (the job journal and SLURM's states now), read once, and MLflow's
    runs of it, read once when first asked."""

    def __init__(self, runs_root: str | Path, experiment: str, tracking_uri: str, overrides: list[str] | None = None):
        self.jobs = journal(runs_root, experiment)
        self.states = job_states(self.jobs)
        self.experiment, self.tracking_uri = experiment, tracking_uri
        self.overrides = list(overrides or [])
        """The overrides the runs were planned with: a repair command repeats them (a run key is theirs)."""

    @cached_property
    def mlflow(self) -> dict[str, object]:
        """The MLflow run of each run key."""
        return runs_by_key(self.experiment, self.tracking_uri)

    def job(self, key: str) -> Worker:
        """What the journal's latest job of `key` (a run key, `profile:<key>`, `prepare:<shards>`) is doing now."""
        entry = self.jobs.get(key)
        if entry is None:
            return NOBODY
        if entry.get("scheduler") != "slurm":
            alive = local_alive(entry)
            return Worker(RUNNING, f"local process {entry['job_id']} on {entry['host']} runs it", LOCAL) if alive \
                else NOBODY
        state = self.states.get(entry["job_id"], "VANISHED")
        by = f"SLURM job {entry['job_id']} is {state}"
        if state == NEVER_STARTS:
            return Worker(STUCK, by, SLURM)
        if state in ACTIVE:
            return Worker(QUEUED if state == "PENDING" else RUNNING, by, SLURM)
        return NOBODY


def worker_of(spec: RunSpec, sources: Sources) -> Worker:
    """What works on the run now: its latest job while it is queued or running, else a live process holding its run
    directory's lease (a local launch, `study train` by hand, a job no journal knows), else its stuck job, if any."""
    job = sources.job(spec.key)
    if job.what in (RUNNING, QUEUED):
        return job
    holder = held_by(spec.run_dir.path)
    if holder is not None:
        return Worker(RUNNING, f"a live process ({holder}) holds its run directory's lease", LEASE)
    return job


def state_of(spec: RunSpec, sources: Sources) -> RunState:
    """What the run still needs and what works on it: the run directory decides what is done, the scheduler and the
    lease what works on it; MLflow's status is compared with the run directory and any disagreement named."""
    trained = final_step(spec) is not None
    # a tune run that diverged is settled, and MLflow rightly holds it FAILED, with the reason
    settled_as = "FAILED" if trained and diverged(spec) else "FINISHED"
    needs = (TRAINING if not trained else EVALUATION if spec.config.eval.after_train and not evaluated(spec)
             else NOTHING)
    worker = worker_of(spec, sources)
    run = sources.mlflow.get(spec.key)
    mlflow = run.info.status if run is not None else "-"
    disagreement = ""
    if trained and mlflow != settled_as:
        said = "holds no run of it" if mlflow == "-" else f"says {mlflow}"
        disagreement = f"its run directory holds its result.json, yet MLflow {said}"
        needs = MIRROR if needs == NOTHING else needs
    elif mlflow == "FINISHED" and not trained:
        disagreement = "MLflow says FINISHED, yet its run directory holds no result.json"
    elif mlflow == "RUNNING" and worker.what is None:
        disagreement = "MLflow says RUNNING, yet no job runs it and no live process holds its run directory's lease"
    blocked = dead_end(spec, sources, mlflow) if needs == TRAINING and worker.what not in (RUNNING, QUEUED) else ""
    return RunState(spec.key, needs, worker, mlflow, disagreement, settled_as == "FAILED", blocked)


def restart_command(experiment: str, overrides: list[str], key: str) -> str:
    """The launch that trains run `key` again from step 0, its earlier training and MLflow run set aside
    (study.train.restart), with the overrides its plan was made with."""
    return shlex.join(["study", "launch", experiment, *redact(list(overrides)), "--restart", key])


DIVERGED_REASON = re.compile(r"(training|validation) loss is (nan|-?inf) at step (\d+)")
"""The failure reason MLflow holds for a run whose loss went non-finite (study.train.callbacks.Diverged): resumed,
it trains the same batches from the same weights into the same divergence."""


def dead_end(spec: RunSpec, sources: Sources, mlflow: str) -> str:
    """Why the untrained run's job would fail at every launch, and the command that repairs it; empty when it
    would not."""
    def restart(key: str) -> str:
        return f"`{restart_command(sources.experiment, sources.overrides, key)}`"

    if mlflow == "FINISHED" and at_step(spec.run_dir.path, spec.last_step) is None:
        return ("MLflow holds it FINISHED, yet its run directory holds neither its result.json nor its final "
                f"checkpoint, so its job would refuse to reopen that result of record at every launch: "
                f"{restart(spec.key)} trains it again from step 0 (that MLflow run is set aside)")
    if spec.role != Role.branch or latest(spec.run_dir.path) is not None or branch_ready(spec):
        return ""  # it resumes at its own checkpoint, or starts from its trunk's
    step, key = spec.first_step, str(spec.trunk)
    trunk = sources.mlflow.get(key)
    if trunk_past(spec) or (trunk is not None and trunk.info.status == "FINISHED"):
        return (f"its trunk {key} trained past step {step} and no longer holds its checkpoint there, which the "
                f"branch starts from: {restart(key)} trains the trunk again from step 0, and the branch from that "
                "checkpoint once it is written")
    reason = trunk.data.tags.get(TAG_FAILURE_REASON, "") if trunk is not None and trunk.info.status == "FAILED" else ""
    nan = DIVERGED_REASON.search(reason)
    if nan and int(nan.group(3)) <= step and sources.job(key).what not in (RUNNING, QUEUED):
        return (f"its trunk {key} diverged ({reason}) before writing its checkpoint at step {step}, which the branch "
                "starts from, and resumed it diverges again: lower the arm's LR (train.lr; new runs), or, if a fault "
                f"made it diverge, {restart(key)} trains the trunk again")
    return ""
