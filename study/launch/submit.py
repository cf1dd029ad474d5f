"""`study launch`: submit what an experiment still needs, as SLURM job arrays (or local processes), idempotently.

Stages: data preparation (a CPU-only job per shard entry not yet in the cache, so no GPU waits on tokenisation) ->
tune runs (an experiment with `tune:`) -> training runs (the reference runs among them) -> geometry profiles of
finished references -> runs scheduled from those profiles, chained with `afterok`. Main runs whose LR waits for their
variant's tuning are submitted by the launch that finds it decided: a local launch launches again when its tune runs
are done, a SLURM launch leaves a small relaunch job after the tune array (study.plan.tune). Before anything is
submitted every run's spec is written to its run directory (`run.json`) and the launch manifest is recorded; each
job reads its spec and nothing else. What each run still needs is its state (study.launch.run_state): a run its run
directory holds finished (result.json, and its evaluation of record when it is to be evaluated) and MLflow FINISHED is
skipped, and so is one whose job is still pending or running, or that a live process trains (its run directory's lease
is held: a local launch beside a SLURM one, `study train` by hand), saying so; a failed or vanished run is submitted
again and resumes from its checkpoint, and where MLflow and the run directory disagree the run directory wins and the
launch names the disagreement. A job that can never start (a job it waits for failed or was cancelled) is cancelled
and its run submitted again, and so are queued jobs of runs the plan no longer has (an edited experiment file). A
relaunch whose overrides change run identities names the new runs and asks for `--new-runs` instead of training them
silently. This module decides what to submit; study.launch.local watches the local processes and `--wait`.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass, field, replace

from study.config.cluster import ClusterConfig
from study.config.spec import held_spec, write_spec
from study.eval.records import final_step
from study.errors import StudyError
from study.launch.branching import release_ready
from study.launch.kinds import JobKind, build_executor, job_name, sbatch_preview
from study.launch.local import LaunchFailed, check_local_layout, follow, run_local
from study.launch.manifest import latest_manifest, new_runs, write_manifest
from study.launch.racing import write_roster
from study.launch.run_state import restart_command
from study.launch.scheduler import cancel, check_slurm, outside_allocation, record
from study.launch.stages import Queue, Stage, dependencies, plan_stages, runs_root, say_skipped, stage_lines, \
    submit_stage
from study.plan.planner import Plan, plan_experiment
from study.plan.tune import write_record
from study.schema import TAG_FAILURE_REASON, submitit_dir
from study.track.groups import ensure_parents
from study.train.checkpoint import latest
from study.config.secrets import mask_text, redact
from study.console import for_terminal

__all__ = ["LaunchFailed", "follow", "launch", "write_specs"]


def write_specs(plan: Plan, echo=print) -> None:
    """Every planned run's spec into its run directory. A scheduled run completed by its job keeps its widths; a
    run that finished, or holds a checkpoint, keeps the spec it trained at (its LR included), so no key ever trains
    at two LRs: where its tuning now says otherwise it is named."""
    for t in plan.tunings.values():
        if t.choices is not None and not t.recorded:  # the choice is made once: later launches read it back
            write_record(t.record, plan.experiment.tuning, t.choices)
    for spec in plan.runs:
        done = held_spec(spec)
        if done is not None and spec.pending is not None and done.pending is None and not spec.awaits_tuning:
            spec = replace(done, config=replace(spec.config, model=done.model))
        trained = None if done is None else ("finished" if final_step(done) is not None else
                                             "trained" if latest(done.run_dir.path) is not None else None)
        if trained and (spec.awaits_tuning or (done.planned.lr, done.planned.final_lr) != (spec.planned.lr,
                                                                                           spec.planned.final_lr)):
            now = ("waits for its tuning" if spec.awaits_tuning
                   else f"says {spec.planned.lr:.6g} ({spec.planned.lr_rule})")
            echo(f"{spec.name} ({spec.key}) {trained} at peak LR {done.planned.lr:.6g} ({done.planned.lr_rule}); "
                 f"the plan now {now}: kept as trained, its run.json unchanged; "
                 f"`{restart_command(plan.experiment.name, plan.overrides, spec.key)}` trains it again at the plan's "
                 "LR")
            continue
        write_spec(spec)


def launch(experiment: str, overrides: list[str], dry_run: bool = False, wait: bool = False, echo=print,
           new: bool = False, extra_seeds: dict[str, dict[str, list[int]]] | None = None,
           tried: frozenset[str] = frozenset()) -> list[Stage]:
    """Submit every stage that still has work; returns the stages (with job ids unless dry_run). `new` allows runs
    the last launch of the experiment did not have (overrides that change run identities); `extra_seeds` adds seeds
    per scale and variant (:func:`study.plan.planner.plan_experiment`). `tried` are the tune runs the launch that
    relaunches itself after its tune runs (locally, or as a SLURM job) already trained: one that did not settle is
    named and never submitted again by it, so a relaunch after tuning always ends."""
    plan = plan_experiment(experiment, overrides, extra_seeds)
    cluster = plan.runs[0].config.cluster
    if cluster.name == "local":
        check_local_layout(cluster)
    elif not dry_run:
        check_slurm()
    tracking_uri = plan.runs[0].config.tracking.uri
    last = latest_manifest(runs_root(plan), experiment, tracking_uri)
    if extra_seeds is None and last and last.get("extra_seeds") and last["overrides"] == redact(list(overrides)):
        # the seeds an adaptive launch added stay part of the experiment when it is relaunched plainly
        plan = plan_experiment(experiment, overrides, last["extra_seeds"])
    # points a tuning adds beyond its grid's edge are new by design: the tune block that decides them is unchanged
    fresh = new_runs([r.key for r in plan.runs if not (r.tuned and r.tuned.status == "extension")], last)
    if fresh and not new and not dry_run:
        names = ", ".join(f"{r.name} ({r.key})" for r in plan.runs if r.key in fresh)
        same = last.get("overrides") == redact(list(overrides))
        why = ("the experiment file (or a preset under sweeps/) changed since, and changes their identity" if same
               else "the overrides change their identity")
        fix = ("pass --new-runs to train them, or restore the file as it was at the last launch" if same else
               "pass --new-runs to train them, or relaunch with the last launch's overrides (shown by `study status`)")
        raise StudyError("experiment" if same else "overrides", f"{len(fresh)} of {len(plan.runs)} planned runs of "
                         f"{experiment} are not in its last launch: {why}, so they would train as new runs: {names}",
                         fix)
    queue = Queue(plan)
    stages = _without_tried(plan_stages(plan, queue), tried, queue, experiment, echo)
    for t in plan.tunings.values():
        if t.note and t.choices is None:
            echo(f"tuning of {t.variant}: {t.note}")
    from study.plan.memory import check_launch

    # the training jobs (not data preparation, not profiles); a dry run says what the launch would
    check_launch([r for s in stages if s.kind.trains for r in s.runs])
    if dry_run:
        _act_on_stale(queue, echo, dry_run=True)
        _print_dry_run(plan, stages, cluster, echo)
        return stages
    from study.config.data import validate_data
    from study.config.tasks import check_tasks

    for data in {json.dumps(asdict(r.config.data), sort_keys=True): r.config.data for r in plan.runs}.values():
        validate_data(data)  # what every job would fail on is refused before anything is submitted
    # tasks evaluated after training must exist: lm-eval's catalogue is indexed only when a run names a task that is
    # not one of the shipped offline ones (indexing takes seconds)
    check_tasks(sorted({t for r in plan.runs if r.config.eval.after_train for t in r.config.eval.tasks}),
                field="eval.tasks")
    if cluster.name == "local" and cluster.warm_start:
        from study.launch.warm import named_server

        named_server()  # a STUDY_WARM_SERVER another user could own is refused before anything is written
    write_specs(plan, echo)
    write_manifest(runs_root(plan), experiment, plan.overrides, [r.key for r in plan.runs], tracking_uri,
                   plan.extra_seeds)
    ensure_parents(tracking_uri, experiment, plan.runs)  # before any job: seed runs starting together find them
    write_roster(plan)  # a racing experiment's roster: what its branch jobs decide the rungs from
    _act_on_stale(queue, echo, dry_run=False)
    released = release_ready(plan.runs, queue.jobs, queue.states) if cluster.name != "local" else []
    if released:
        echo(f"released {len(released)} held branch jobs whose trunk checkpoints exist: {', '.join(released)}")
    if not stages:
        echo(f"{experiment}: nothing to submit, every planned run is finished or in the queue")
        return []
    if cluster.name == "local":
        done = run_local(plan, stages, echo)
        tuned = _tune_keys(stages)
        if any(r.awaits_tuning for r in plan.runs) and tuned:
            # the tune runs have settled: the next launch finds the choice (or the points beyond an edge)
            return done + launch(experiment, overrides, echo=echo, new=True, extra_seeds=extra_seeds,
                                 tried=tried | tuned)
        return done
    submitted = Queue(plan).live()  # read again: the jobs cancelled above are no one's dependency
    for stage in stages:
        stage.after = dependencies(stage, submitted)  # now including the stages submitted just before
        jobs = submit_stage(plan, stage)
        submitted.update({k: j.job_id for k, j in zip(stage.keys(), jobs)})
        what = "shard entries (CPU)" if stage.on_shards else "runs"
        echo(f"stage {stage.name}: submitted {len(jobs)} {what} as array {jobs[0].job_id.split('_')[0]}"
             + (f" (afterok {','.join(stage.after)})" if stage.after else ""))
        for line, job in zip(stage_lines(stage), jobs):
            echo(f"  {job.job_id}  {line}")
    tune_jobs = [j for s in stages if s.kind is JobKind.tune for j in s.job_ids]
    if tune_jobs and any(r.awaits_tuning for r in plan.runs):
        _relaunch_after(plan, overrides, tune_jobs, tried | _tune_keys(stages), echo)
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
    tried: list[str] = field(default_factory=list)
    """Tune runs the launches before it trained: never submitted again by it (a run that failed, or diverged
    without settling, would otherwise be retried forever)."""

    def __call__(self) -> int:
        launch(self.experiment, self.overrides, echo=lambda line: print(line, flush=True), new=True,
               tried=frozenset(self.tried))
        return 0


def _tune_keys(stages: list[Stage]) -> frozenset[str]:
    return frozenset(r.key for s in stages if s.kind is JobKind.tune for r in s.runs)


def _without_tried(stages: list[Stage], tried: frozenset[str], queue: Queue, experiment: str, echo) -> list[Stage]:
    """The stages less the tune runs this chain of relaunches already trained, each named with why it is unsettled."""
    out = []
    for stage in stages:
        again = [r for r in stage.runs if r.key in tried] if stage.kind is JobKind.tune else []
        for r in again:
            run = queue.mlflow.get(r.key)
            why = (run.data.tags.get(TAG_FAILURE_REASON) if run is not None else None) or "it left no result"
            echo(f"not submitted again: tune run {r.name} ({r.key}) was trained after this launch began and did not "
                 f"finish ({why}); its variant's main runs wait for it: fix the cause and run `study launch "
                 f"{experiment}` again")
        stage.runs = [r for r in stage.runs if r.key not in tried] if again else stage.runs
        if stage.runs:
            out.append(stage)
    return out


def _relaunch_after(plan: Plan, overrides: list[str], after: list[str], tried: frozenset[str], echo) -> None:
    cfg = plan.runs[0].config
    # `afterany`: a failed tune run is reported by the relaunch, which resubmits it
    ex = build_executor(cfg.cluster, submitit_dir(cfg.paths.runs, cfg.experiment) / "%j",
                        job_name(f"{cfg.experiment}-after-tuning"), JobKind.relaunch, after=after,
                        condition="afterany")
    with outside_allocation():
        job = ex.submit(RelaunchJob(plan.experiment.name, list(overrides), sorted(tried)))
    record(runs_root(plan), plan.experiment.name, [{"key": "relaunch:tune", "job_id": job.job_id,
                                                    "stage": JobKind.relaunch.value,
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
    say_skipped(queue, echo)


def _print_dry_run(plan: Plan, stages: list[Stage], cluster: ClusterConfig, echo) -> None:
    if not stages:
        echo(f"{plan.experiment.name}: nothing to submit, every planned run is finished or in the queue")
    for i, stage in enumerate(stages):
        upstream = {JobKind.tune: "data", JobKind.train: "data", JobKind.branch: "data",
                    JobKind.profile: "reference runs", JobKind.scheduled: "profiles"}.get(stage.kind)
        # data comes from the prepare array (the first); reference runs and profiles from the array just before
        source = (stages[0].kind if stages[0].on_shards else None) if upstream == "data" else (
            stages[i - 1].kind if i else None)
        after = stage.after + ([f"<its {upstream} in the {source} array>"] if source and upstream else [])
        what = "shard entries to tokenise (CPU only)" if stage.on_shards else "runs"
        echo(f"stage {stage.name}: array of {len(stage.runs)} {what}"
             + (f", afterok on {', '.join(after)}" if after else "")
             + (", held (sbatch --hold): each trunk's job releases its branches as it writes their start "
                "checkpoints" if stage.held and cluster.name != "local" else
                ", after the trunks' stage (each starts from its trunk's checkpoint)" if stage.held else ""))
        for line in stage_lines(stage):
            echo(f"  {line}")
        echo(for_terminal(mask_text(sbatch_preview(plan, stage.kind, len(stage.runs), after, stage.held,
                                                     stage.runs[0].config.cluster)))
             if cluster.name != "local"
             else "  (local processes, no sbatch script)")
    held = [r for r in plan.runs if r.awaits_tuning]
    if held:
        echo(f"held: {len(held)} main runs wait for their variant's tuning; they are submitted by the launch that "
             "finds it decided")
        for r in held:
            echo(f"  {r.key}  {r.name}: waits for the {r.pending}")
    if held and any(s.kind is JobKind.tune for s in stages):
        echo("stage relaunch: one CPU job (afterany on the tune array) runs `study launch` again once the tune runs "
             "end" if cluster.name != "local" else "stage relaunch: this launch launches again once its tune runs end")
