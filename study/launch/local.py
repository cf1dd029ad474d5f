"""The launcher's watch over the jobs it submitted. Laptop mode: a launch's stages as local processes, one stage after
the other, `array_parallelism` at a time; a signal to the launcher stops its jobs first (each run checkpoints and
stops). Its live table shows each run's state, step of total, loss, tokens/s and ETA, read from the progress.json its
trainer replaces at every logged step; it redraws only on a terminal: a pipe or a file gets the launcher's plain
`done` / `FAILED` lines. On SLURM, `--wait`: the launch's jobs followed until none is pending or running."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable

from study.config.cluster import ClusterConfig
from study.config.spec import RunSpec
from study.errors import LaunchFailed, StudyError
from study.files import COUNT, NUMBER, Kind, optional, read_json, shape_problem
from study.launch.kinds import JobKind
from study.launch.racing import settle, stopped_keys
from study.launch.scheduler import ACTIVE, job_states, journal
from study.launch.stages import Queue, Stage, runs_root, say_skipped, stage_lines, submit_stage
from study.launch.warm import shared
from study.plan.planner import Plan

WAITING, RUNNING, DONE, FAILED = "waiting", "running", "done", "FAILED"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class LiveTable:
    """The table for `runs`; `mark(key, state)` records what the launcher knows (running, done, FAILED)."""

    def __init__(self, runs: Iterable[RunSpec]):
        self.runs = list(runs)
        self.states = {r.key: WAITING for r in self.runs}
        self._live = None

    def mark(self, key: str, state: str) -> None:
        self.states[key] = state

    def rows(self) -> list[tuple[str, ...]]:
        """(run, state, step, loss, tokens/s, ETA) per run, as shown."""
        out = []
        for run in self.runs:
            figures, state = _read(run), self.states[run.key]
            out.append((run.name, state, "-", "-", "-", "-") if figures is None else
                       (run.name, state, f"{figures['step']}/{figures['max_steps']}", f"{figures['loss']:.4f}",
                        f"{figures['tokens_per_s']:,.0f}",
                        "-" if state in (DONE, FAILED) else _duration(figures.get("eta_s"))))
        return out

    def table(self):
        from rich.table import Table

        done = sum(s == DONE for s in self.states.values())
        table = Table(title=f"{done} of {len(self.runs)} runs done")
        for col in ("run", "state", "step", "loss", "tokens/s", "ETA"):
            table.add_column(col, justify="left" if col in ("run", "state") else "right")
        for row in self.rows():
            table.add_row(*row)
        return table

    def __enter__(self) -> LiveTable:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=sys.stderr)
        if console.is_terminal:
            self._live = Live(get_renderable=self.table, console=console, refresh_per_second=2, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()


_LOSS = Kind("a number, NaN once diverged", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
_FIGURES = {"step": COUNT, "max_steps": COUNT, "loss": _LOSS, "tokens_per_s": NUMBER, "eta_s": optional(NUMBER)}


def _read(run: RunSpec) -> dict | None:
    """The run's latest figures; None (shown as unknown) while it has none, or holds what is not its figures: the
    trainer replaces the file at its next logged step, so a damaged one is never a reason to stop the launch."""
    try:
        figures = read_json(run.run_dir.progress, "")  # a link in its place is refused, as everywhere in a run folder
    except StudyError:
        return None
    return None if shape_problem(figures, _FIGURES) else figures


def check_local_layout(cluster: ClusterConfig) -> None:
    """A local launch runs each job as one process and starts no process group, so a layout of several ranks (or
    tasks, which submitit's local executor would start as copies of the job) would train on one rank while the plan
    split its batch for more, the other tasks only waiting on the run's lease: refused before anything is written or
    started, naming the field that multiplies the ranks."""
    if cluster.ranks == 1 and cluster.tasks_per_node == 1:
        return
    field = ("cluster.nodes" if cluster.nodes > 1 else
             "cluster.gpus_per_node" if cluster.gpus_per_node > 1 else "cluster.tasks_per_node")
    value = getattr(cluster, field.split(".")[1])
    ranks = cluster.ranks if cluster.ranks > 1 else value
    raise StudyError(field, f"is {value}, and a local launch trains each run as one process on one rank"
                     + (f" (the plan splits each step over {cluster.ranks})" if cluster.ranks > 1 else ""),
                     f"set {field}=1 for a local launch; to train one run on {ranks} local ranks use "
                     f"`study train --nproc {ranks} experiment=... variant=... scale=... seed=...`, or launch on "
                     "SLURM (cluster=slurm)")


class _Stopped(BaseException):
    def __init__(self, signum: int):
        self.signum = signum


def run_local(plan: Plan, stages: list[Stage], echo, poll_s: float = 0.2) -> list[Stage]:
    """Laptop mode: stages run one after the other, each keeping `array_parallelism` processes busy (a job starts as
    soon as another ends, so a short run never leaves a core idle behind a long one). A signal to the launcher
    (TERM, HUP, INT) stops its jobs first: each run checkpoints and stops, nothing keeps training."""
    parallel = max(1, plan.runs[0].config.cluster.array_parallelism)
    racing = plan.experiment.racing is not None
    failures: list[tuple[RunSpec, str]] = []
    running: list[tuple[RunSpec, str, object]] = []  # (run, its line, its job) of each job now running

    def stop(signum, frame):
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    warm = shared() if plan.runs[0].config.cluster.warm_start else None
    python = warm.python if warm else None
    try:
        with LiveTable([r for stage in stages if not stage.on_shards for r in stage.runs]) as board:
            for stage in stages:
                what = "shard entries to tokenise" if stage.on_shards else "runs"
                echo(f"stage {stage.name}: {len(stage.runs)} {what}, {parallel} at a time (local)")
                mark = board.mark if not stage.on_shards else lambda key, state: None  # the board follows runs
                for rung in _rungs(stage):
                    if stage.kind is JobKind.branch and racing:
                        # the rungs this launch's branches completed are decided; a stopped arm's later branches
                        # are not trained
                        settle(runs_root(plan), plan.experiment.name, plan.runs[0].config.tracking.uri)
                        stopped = stopped_keys(plan)
                        for i in rung:
                            run = stage.runs[i]
                            if run.key in stopped:
                                board.mark(run.key, "stopped (racing)")
                                echo(f"  skipped {run.key}  {run.name}: {stopped[run.key]}")
                        rung = [i for i in rung if stage.runs[i].key not in stopped]
                    while rung or running:
                        while rung and len(running) < parallel:
                            one = _start(plan, stage, rung.pop(0), echo, board, python)
                            if one is not None:
                                running.append(one)
                                mark(one[0].key, RUNNING)
                        ended = [one for one in running if one[2].done()]
                        if running and not ended:
                            time.sleep(poll_s)
                        for run, line, job in ended:
                            running.remove((run, line, job))
                            stage.job_ids.append(job.job_id)
                            try:
                                job.results()  # every rank's: a job of several tasks has no single result
                                mark(run.key, DONE)
                                echo(f"  done    {line}")
                            except Exception as err:  # a failed run must not stop its siblings
                                reason = failure_reason(err)
                                failures.append((run, reason))
                                mark(run.key, FAILED)
                                echo(f"  FAILED  {line}: {reason}")
                if stage.kind is JobKind.branch and racing:
                    settle(runs_root(plan), plan.experiment.name, plan.runs[0].config.tracking.uri)
                if stage.on_shards and failures:  # the runs read these shards: none can train without them
                    raise LaunchFailed("data preparation failed, so no run was trained: "
                                       + "; ".join(f"{r.config.data.name}: {why}" for r, why in failures))
    except (_Stopped, KeyboardInterrupt) as stopped:
        stop_jobs([job for _, _, job in running])
        signum = getattr(stopped, "signum", signal.SIGINT)
        echo(f"stopped by {signal.Signals(signum).name}: {len(running)} running jobs checkpointed and stopped; "
             "`study launch` again resumes them")
        raise SystemExit(128 + signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failures:
        runs = sum(len(s.runs) for s in stages if not s.on_shards)
        raise LaunchFailed(f"{len(failures)} of {runs} runs failed: "
                           + "; ".join(f"{r.name} ({r.key}): {why}" for r, why in failures)
                           + ". `study launch` again resumes them from their checkpoints")
    return stages


def _start(plan: Plan, stage: Stage, i: int, echo, board, python: str | None) -> tuple[RunSpec, str, object] | None:
    """The stage's `i`-th job started on its own (by `python`, the warm server's client, when given): its run, its
    line and its job; None when the run is not to train now."""
    one = Stage(stage.kind, [stage.runs[i]], groups=[stage.groups[i]] if stage.groups else [])
    if stage.kind.trains:
        # a SLURM launch (or `study train`) since this launch began may have taken the run; nor does a branch whose
        # trunk failed in this launch before writing its start train
        queue = Queue(plan)
        run = one.runs[0]
        skip = queue.busy(run.key, run) or (stage.kind is JobKind.branch and queue.dead_end(run))
        say_skipped(queue, echo)
        for key in queue.elsewhere:
            board.mark(key, "taken elsewhere")
        for key in queue.blocked:
            board.mark(key, "not submitted")
        if skip:
            return None
    (job,) = submit_stage(plan, one, python=python)
    return one.runs[0], stage_lines(one)[0], job


def _rungs(stage: Stage) -> list[list[int]]:
    """The stage's jobs in the order they start; branches rung by rung (a rung's jobs all end before the next rung's
    start), so a race decides each rung before the next one trains."""
    rungs: dict[float, list[int]] = {}
    for i, r in enumerate(stage.runs):
        rungs.setdefault(r.points[0].at if stage.kind is JobKind.branch else 0.0, []).append(i)
    return [mine for _, mine in sorted(rungs.items())]


def failure_reason(err: BaseException) -> str:
    """The line that says why a local job failed, and where its log is. submitit's error for a failed job holds the
    job's traceback and then its log paths: the reason is the exception the traceback ends on (`run 2f9240731574
    failed: training loss is nan at step 5`), not the last line; a job that died without one (killed, out of memory)
    is described by the last line its error stream wrote."""
    # submitit frames a log it quotes with rules of dashes: a rule says nothing, and an empty log leaves one last
    lines = [line.rstrip() for line in str(err).splitlines() if line.strip().strip("-=")]
    if not lines:
        return type(err).__name__
    if "has not produced any output" in str(err) and lines[-1].startswith(
            ("No error stream produced", "No output/error stream produced")):
        # a job that ended with neither a result nor a line of its own (killed, or a command that failed at once);
        # submitit's state says FINISHED for any local process that exited, so it is not repeated
        return f"the job ended without a result or a line of output ({lines[-1].split(': ', 1)[-1]})"
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    raised = [line for line in lines[starts[-1] + 1:] if not line[0].isspace()] if starts else []
    paths = [line.split("- ", 1)[1] for line in lines if line.lstrip().startswith("- ") and line.endswith("_log.err")]
    if not raised:
        return lines[-1].strip()
    # the exception's type and run-level prefix say nothing the launch's own message does not
    reason = re.sub(r"^run [0-9a-f]+ failed: ", "", re.sub(r"^[\w.]+(Error|Exception): ", "", raised[0]))
    return reason + (f" (log: {paths[-1]})" if paths else "")


def stop_jobs(jobs: list, grace_s: float = 120.0) -> None:
    """TERM to each local job's controller, which forwards it to the training process (checkpoint, then stop)."""
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
            jobs = journal(runs_root(plan), plan.experiment.name)
            ids = [e["job_id"] for e in jobs.values() if e.get("scheduler") == "slurm"]
            states = job_states(jobs)
            counts = Counter(states.get(j, "VANISHED") for j in ids)
            live.update(" ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
            if not any(states.get(j) in ACTIVE for j in ids):
                break
            time.sleep(poll_s)
