"""`study launch`: submit what an experiment still needs, as SLURM job arrays (or local processes), idempotently.

Stages: data preparation (a CPU-only job per shard entry not yet in the cache, so no GPU waits on tokenisation) ->
tune runs (an experiment with `tune:`) -> training runs (the reference runs among them) -> geometry profiles of
finished references -> runs scheduled from those profiles, chained with `afterok`. Main runs whose LR waits for their
variant's tuning are submitted by the launch that finds it decided: a local launch launches again when its tune runs
are done, a SLURM launch leaves a small relaunch job after the tune array (study.plan.tune). Before anything is
submitted every run's spec is written to its run directory (`run.json`) and the launch manifest is recorded; each
job reads its spec and nothing else. A run whose key is FINISHED in MLflow is skipped, and so is one whose job is
still pending or running, or that a live process trains (its run directory's lease is held: a local launch beside a
SLURM one, `study train` by hand), saying so; a failed or vanished run is submitted again and resumes from its
checkpoint. A job that can never start (a job it waits for failed or was cancelled) is cancelled and its run
submitted again, and so are queued jobs of runs the plan no longer has (an edited experiment file). A relaunch whose
overrides change run identities names the new runs and asks for `--new-runs` instead of training them silently.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass, field, replace

from study.config.sections import ClusterConfig
from study.config.spec import RunSpec, read_spec, write_spec
from study.data.stage import PREPARE, DataGroup, missing_groups, shards_id
from study.errors import StudyError
from study.launch.board import DONE, FAILED, RUNNING, RunBoard
from study.launch.executor import _executor, _safe_name, sbatch_preview
from study.launch.manifest import latest_manifest, new_runs, write_manifest
from study.launch.scheduler import (ACTIVE, STUCK, active, cancel, check_slurm, job_states, journal,
                                    outside_allocation, record)
from study.plan.planner import Plan, plan_experiment
from study.plan.tune import write_record
from study.schema import submitit_dir
from study.track.groups import ensure_parents
from study.track.params import mask_text, redact
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


def _root(plan: Plan) -> str:
    return plan.runs[0].config.paths.runs


class Queue:
    """The experiment's job journal and what the schedulers say of its jobs now, read once."""

    def __init__(self, plan: Plan):
        self.jobs = journal(_root(plan), plan.experiment.name)
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
    from study.launch.jobs import PrepareJob, ProfileJob, TrainJob

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
    record(_root(plan), plan.experiment.name, [{"key": k, "job_id": j, "stage": stage.name, "scheduler": scheduler,
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


def write_specs(plan: Plan) -> None:
    """Every planned run's spec into its run directory. A scheduled run completed by its job keeps its widths."""
    for spec in plan.runs:
        path = spec.run_dir.spec
        if path.is_file():
            done = read_spec(path)  # a spec of another schema version is named, never overwritten
            if done.key != spec.key:
                raise StudyError("paths.runs", f"{spec.run_dir.path} holds run {done.key}, not {spec.key}",
                                 "leave run directories as the launcher made them; move the foreign run.json away")
            if spec.pending is not None and done.pending is None and not spec.awaits_tuning:
                spec = replace(done, config=replace(spec.config, model=done.model))
        write_spec(spec)
    for t in plan.tunings.values():
        if t.choices is not None and not t.recorded:  # the choice is made once: later launches read it back
            write_record(t.record, plan.experiment.tuning.identity(), t.choices)


def launch(experiment: str, overrides: list[str], dry_run: bool = False, wait: bool = False, echo=print,
           new: bool = False, extra_seeds: dict[str, dict[str, list[int]]] | None = None) -> list[Stage]:
    """Submit every stage that still has work; returns the stages (with job ids unless dry_run). `new` allows runs
    the last launch of the experiment did not have (overrides that change run identities); `extra_seeds` adds seeds
    per scale and variant (:func:`study.plan.planner.plan_experiment`)."""
    plan = plan_experiment(experiment, overrides, extra_seeds)
    cluster = plan.runs[0].config.cluster
    if cluster.name != "local" and not dry_run:
        check_slurm()
    tracking_uri = plan.runs[0].config.tracking.uri
    last = latest_manifest(_root(plan), experiment, tracking_uri)
    if extra_seeds is None and last and last.get("extra_seeds") and last["overrides"] == redact(list(overrides)):
        # the seeds an adaptive launch added stay part of the experiment when it is relaunched plainly
        plan = plan_experiment(experiment, overrides, last["extra_seeds"])
    # points a tuning adds beyond its grid's edge are new by design: the tune block that decides them is unchanged
    fresh = new_runs([r.key for r in plan.runs if not (r.tuned and r.tuned.status == "extension")], last)
    if fresh and not new and not dry_run:
        names = ", ".join(f"{r.name} ({r.key})" for r in plan.runs if r.key in fresh)
        raise StudyError("overrides", f"{len(fresh)} of {len(plan.runs)} planned runs of {experiment} are not in its "
                         f"last launch: the overrides change their identity, so they would train as new runs: {names}",
                         "pass --new-runs to train them, or relaunch with the last launch's overrides "
                         "(shown by `study status`)")
    queue = Queue(plan)
    stages = plan_stages(plan, queue)
    if dry_run:
        _act_on_stale(queue, echo, dry_run=True)
        _print_dry_run(plan, stages, cluster, echo)
        return stages
    from study.config.data import validate_data

    for data in {json.dumps(asdict(r.config.data), sort_keys=True): r.config.data for r in plan.runs}.values():
        validate_data(data)  # what every job would fail on is refused before anything is submitted
    _check_tasks(plan)
    write_specs(plan)
    write_manifest(_root(plan), experiment, plan.overrides, [r.key for r in plan.runs], tracking_uri,
                   plan.extra_seeds)
    ensure_parents(tracking_uri, experiment, plan.runs)  # before any job: seed runs starting together find them
    _act_on_stale(queue, echo, dry_run=False)
    if not stages:
        echo(f"{experiment}: nothing to submit, every planned run is finished or in the queue")
        return []
    if cluster.name == "local":
        done = _launch_local(plan, stages, echo)
        if any(r.awaits_tuning for r in plan.runs) and any(s.name == "tune" for s in stages):
            # the tune runs have finished: the next launch finds the choice (or the points beyond an edge)
            return done + launch(experiment, overrides, echo=echo, new=True, extra_seeds=extra_seeds)
        return done
    submitted = Queue(plan).live()  # read again: the jobs cancelled above are no one's dependency
    for stage in stages:
        stage.after = dependencies(stage, submitted)  # now including the stages submitted just before
        jobs = submit_stage(plan, stage)
        submitted.update({k: j.job_id for k, j in zip(stage.keys(), jobs)})
        what = "shard entries (CPU)" if stage.name == "prepare" else "runs"
        echo(f"stage {stage.name}: submitted {len(jobs)} {what} as array {jobs[0].job_id.split('_')[0]}"
             + (f" (afterok {','.join(stage.after)})" if stage.after else ""))
        for line, job in zip(_lines(stage), jobs):
            echo(f"  {job.job_id}  {line}")
    tune_jobs = [j for s in stages if s.name == "tune" for j in s.job_ids]
    if tune_jobs and any(r.awaits_tuning for r in plan.runs):
        _relaunch_after(plan, overrides, tune_jobs, echo)
    if wait:
        follow(plan, echo)
    return stages


@dataclass
class RelaunchJob:
    """`study launch` again, as a small CPU job after a tune array: it finds each variant's tuning decided (and
    submits its main runs) or adds the points beyond an edge (and another of itself after them)."""

    experiment: str
    """Experiment name."""
    overrides: list[str]
    """The launch's overrides."""

    def __call__(self) -> int:
        launch(self.experiment, self.overrides, echo=lambda line: print(line, flush=True), new=True)
        return 0


def _relaunch_after(plan: Plan, overrides: list[str], after: list[str], echo) -> None:
    from study.launch.scheduler import outside_allocation

    cfg = plan.runs[0].config
    # one CPU, no GPU; `afterany`: a failed tune run is reported by the relaunch, which resubmits it
    cluster = replace(cfg.cluster, gpus_per_node=0, nodes=1, tasks_per_node=1, cpus_per_task=1, mem_gb=4)
    ex = _executor(cluster, submitit_dir(cfg.paths.runs, cfg.experiment) / "%j",
                   _safe_name(f"{cfg.experiment}-after-tuning"))
    ex.update_parameters(dependency="afterany:" + ":".join(after))
    with outside_allocation():
        job = ex.submit(RelaunchJob(plan.experiment.name, list(overrides)))
    record(_root(plan), plan.experiment.name, [{"key": "relaunch:tune", "job_id": job.job_id, "stage": "relaunch",
                                                "scheduler": "slurm", "name": "after tuning", "after": after,
                                                "host": socket.gethostname(), "time": time.time()}])
    echo(f"stage relaunch: job {job.job_id} (afterany {','.join(after)}) launches the main runs once tuning decides")


def _act_on_stale(queue: Queue, echo, dry_run: bool) -> None:
    """Cancel the SLURM jobs that would wait forever or train runs the plan no longer has, name the superseded
    runs still running, and name each run taken elsewhere; a dry run only says what a launch would do."""
    superseded, running, stuck = queue.stale()

    def jobs(entries: list[dict]) -> str:
        return ", ".join(f"{e['job_id']} {e['name']} ({e['key']})" for e in entries)

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'s' * (n != 1)}"

    cancelled = "would cancel" if dry_run else "cancelled"
    if superseded:
        echo(f"{cancelled} {count(len(superseded), 'queued job')} of runs no longer planned (the experiment file or "
             f"the overrides changed): {jobs(superseded)}")
    if running:
        echo(f"left running: {count(len(running), 'job')} of runs no longer planned: {jobs(running)}; scancel them "
             "if their results are not wanted")
    if stuck:
        echo(f"{cancelled} {count(len(stuck), 'job')} that could never start (a job each waits for failed or was "
             f"cancelled): {jobs(stuck)}; what they were to do is submitted again")
    if not dry_run and superseded + stuck:
        cancel([e["job_id"] for e in superseded + stuck])
    _say_skipped(queue, echo)


def _say_skipped(queue: Queue, echo) -> None:
    for key, (name, why) in queue.elsewhere.items():
        echo(f"skipped {name} ({key}): {why}; it is not submitted twice")


def _lines(stage: Stage) -> list[str]:
    if stage.name == "prepare":
        return [f"{g.data.name} for {len(g.runs)} run{'s' * (len(g.runs) != 1)}" for g in stage.groups]
    return [f"{r.key}  {r.name}" for r in stage.runs]


def _check_tasks(plan: Plan) -> None:
    """Tasks evaluated after training must exist: lm-eval's catalogue is indexed only when a run names a task that
    is not one of the shipped offline ones (indexing takes seconds)."""
    wanted = {t for r in plan.runs if r.config.eval.after_train for t in r.config.eval.tasks}
    hub = sorted(t for t in wanted if not t.endswith("_local"))
    if not hub:
        return
    from lm_eval.tasks import TaskManager

    unknown = sorted(set(hub) - set(TaskManager().all_tasks))
    if unknown:
        raise StudyError("eval.tasks", f"lm-eval has no task {unknown[0]!r}",
                         "use lm-eval task names (arc_easy, hellaswag, piqa) or the offline *_local tasks")


def _print_dry_run(plan: Plan, stages: list[Stage], cluster: ClusterConfig, echo) -> None:
    if not stages:
        echo(f"{plan.experiment.name}: nothing to submit, every planned run is finished or in the queue")
    previous: list[str] = []
    for stage in stages:
        upstream = {"tune": "data", "train": "data", "profile": "reference runs", "scheduled": "profiles"}.get(
            stage.name)
        after = stage.after + ([f"<its {upstream} in the {previous[-1]} array>"] if previous and upstream else [])
        what = "shard entries to tokenise (CPU only)" if stage.name == "prepare" else "runs"
        echo(f"stage {stage.name}: array of {len(stage.runs)} {what}"
             + (f", afterok on {', '.join(after)}" if after else ""))
        for line in _lines(stage):
            echo(f"  {line}")
        echo(mask_text(sbatch_preview(plan, stage.name, len(stage.runs), after)) if cluster.name != "local"
             else "  (local processes, no sbatch script)")
        previous.append(stage.name)


class LaunchFailed(Exception):
    """Some runs of a local launch failed; the message lists each with its reason."""


class _Stopped(BaseException):
    def __init__(self, signum: int):
        self.signum = signum


def _launch_local(plan: Plan, stages: list[Stage], echo) -> list[Stage]:
    """Laptop mode: stages run one after the other, `array_parallelism` processes at a time. A signal to the
    launcher (TERM, HUP, INT) stops its jobs first: each run checkpoints and stops, nothing keeps training."""
    import signal

    parallel = max(1, plan.runs[0].config.cluster.array_parallelism)
    failures: list[tuple[RunSpec, str]] = []
    live: list = []

    def stop(signum, frame):
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with RunBoard([r for stage in stages if stage.name != "prepare" for r in stage.runs]) as board:
            for stage in stages:
                what = "shard entries to tokenise" if stage.name == "prepare" else "runs"
                echo(f"stage {stage.name}: {len(stage.runs)} {what}, {parallel} at a time (local)")
                shown = stage.name != "prepare"  # the board follows training runs
                for i in range(0, len(stage.runs), parallel):
                    chunk = Stage(stage.name, stage.runs[i:i + parallel], groups=stage.groups[i:i + parallel])
                    if stage.name in ("tune", "train", "scheduled"):
                        # a SLURM launch (or `study train`) since this launch began may have taken runs it had not
                        # started yet
                        queue = Queue(plan)
                        chunk.runs = [r for r in chunk.runs if not queue.busy(r.key, r)]
                        _say_skipped(queue, echo)
                        for key in queue.elsewhere:
                            board.mark(key, "taken elsewhere")
                        if not chunk.runs:
                            continue
                    live[:] = submit_stage(plan, chunk)
                    for run in chunk.runs if shown else []:
                        board.mark(run.key, RUNNING)
                    for run, line, job in zip(chunk.runs, _lines(chunk), live):
                        try:
                            job.result()
                            if shown:
                                board.mark(run.key, DONE)
                            echo(f"  done    {line}")
                        except Exception as err:  # a failed run must not stop its siblings
                            reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                            failures.append((run, reason))
                            if shown:
                                board.mark(run.key, FAILED)
                            echo(f"  FAILED  {line}: {reason}")
                    stage.job_ids += [j.job_id for j in live]
                    live.clear()
                if stage.name == "prepare" and failures:  # the runs read these shards: none can train without them
                    raise LaunchFailed("data preparation failed, so no run was trained: "
                                       + "; ".join(f"{r.config.data.name}: {why}" for r, why in failures))
    except (_Stopped, KeyboardInterrupt) as stopped:
        _stop_jobs(live)
        signum = getattr(stopped, "signum", signal.SIGINT)
        echo(f"stopped by {signal.Signals(signum).name}: {len(live)} running jobs checkpointed and stopped; "
             "`study launch` again resumes them")
        raise SystemExit(128 + signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failures:
        runs = sum(len(s.runs) for s in stages if s.name != "prepare")
        raise LaunchFailed(f"{len(failures)} of {runs} runs failed: "
                           + "; ".join(f"{r.name} ({r.key}): {why}" for r, why in failures)
                           + ". `study launch` again resumes them from their checkpoints")
    return stages


def _stop_jobs(jobs: list, grace_s: float = 120.0) -> None:
    """TERM to each local job's controller, which forwards it to the training process (checkpoint, then stop)."""
    import signal
    import subprocess

    procs = [getattr(j, "_process", None) for j in jobs]  # submitit's LocalJob keeps its Popen here
    procs = [p for p in procs if p is not None and p.poll() is None]
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def follow(plan: Plan, echo, poll_s: float = 5.0) -> None:
    """Wait until no submitted job of the experiment is pending or running, showing counts by state."""
    from rich.live import Live

    with Live(refresh_per_second=1, transient=False) as live:
        while True:
            jobs = journal(_root(plan), plan.experiment.name)
            ids = [e["job_id"] for e in jobs.values() if e.get("scheduler") == "slurm"]
            states = job_states(jobs)
            counts: dict[str, int] = {}
            for j in ids:
                st = states.get(j, "VANISHED")
                counts[st] = counts.get(st, 0) + 1
            live.update(" ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
            if not any(states.get(j) in ACTIVE for j in ids):
                break
            time.sleep(poll_s)
