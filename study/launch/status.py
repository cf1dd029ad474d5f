"""`study status`: every launched run of an experiment with its MLflow state, its scheduler's view of it, and the one
word to act on, from the run's state (:func:`study.launch.run_state.state_of`). Without overrides the runs are those
of the experiment's last launch (its manifest), so a sweep launched with `cluster=h100` shows without repeating it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from study import schema
from study.config.run import Role
from study.config.spec import RunSpec
from study.launch.branching import branch_ready
from study.launch.manifest import latest_manifest
from study.launch.racing import stopped_keys
from study.launch.run_state import EVALUATION, LEASE, MIRROR, NOTHING, QUEUED, RUNNING, STUCK, RunState, Sources, \
    state_of
from study.launch.scheduler import DEAD
from study.plan.planner import Plan, plan_experiment
from study.train import checkpoint


LOCAL = "local process"
COLUMNS = ("run key", "run", "role", "MLflow status", "job id", "scheduler state", "checkpoint step",
           "val/loss (last)", "restarts", "state")
"""`study status` columns: `scheduler state` is SLURM's view of the job (or `local process`), `state` the one word
to act on."""


@dataclass
class RunStatus:
    key: str
    name: str
    role: str
    """The run's role: train, reference, scheduled, tune (study.config.run.Role)."""
    mlflow: str
    """MLflow run status, or `-` when the run never started."""
    job_id: str
    """SLURM job id (`<array>_<task>` for an array task), or the local process id, `-` when never submitted."""
    job_state: str
    """What the scheduler says now: a SLURM state (or DEPENDENCY_NEVER_SATISFIED for a job that can never start),
    `local process` for a local job (no queue keeps its state), `-` when never submitted."""
    last_step: int | None
    val_loss: float | None
    restarts: int
    verdict: str
    """One word a person acts on (details in parentheses): finished, running, queued, stuck, blocked (a dead end, with
    its repair), not evaluated, MLflow behind, failed, died, not finished, not submitted, waiting for its tuning,
    diverged (a settled tune point)."""
    state: RunState
    """The run's one answer: what it still needs and what works on it."""


def _verdict(planned: RunSpec, state: RunState, job_state: str, submitted: bool, stopped: str | None) -> str:
    if planned.awaits_tuning and not submitted and not state.done:
        return "waiting for its tuning"
    if stopped and not state.done:
        return f"stopped ({stopped})"
    word, details = _word(state, job_state, submitted)
    if state.disagreement and not state.blocked:  # a dead end's reason says it already
        details.append(f"{state.disagreement}: the run directory wins")
    if word == QUEUED and not details and planned.role == Role.branch and not branch_ready(planned):
        details = [f"held until trunk {planned.trunk} writes step {planned.first_step}"]  # its job is held till then
    return f"{word} ({'; '.join(details)})" if details else word


def _word(state: RunState, job_state: str, submitted: bool) -> tuple[str, list[str]]:
    if state.needs == NOTHING:
        return ("diverged", ["a tune point: its loss counts as the worst, the tuning goes on"]) if state.diverged \
            else ("finished", [])
    if state.worker.what == STUCK:
        return "stuck", ["a job it waits for failed or was cancelled, so it never starts; `study launch` resubmits it"]
    if state.worker.what in (QUEUED, RUNNING):
        return state.worker.what, [state.worker.by] if state.worker.source == LEASE else []
    if state.blocked:
        return "blocked", [f"no job can train it, so `study launch` submits none: {state.blocked}"]
    if state.needs == MIRROR:
        return "MLflow behind", ["`study launch` brings MLflow the result"]
    if state.needs == EVALUATION:
        return "not evaluated", ["trained; `study launch` evaluates its final checkpoint"]
    if state.mlflow == "FAILED":
        return "failed", []
    if state.mlflow == "RUNNING" or (submitted and job_state in DEAD):  # nothing works on it: it stopped unsaid
        return "died", [job_state.lower()] if job_state in DEAD else []
    if not submitted:
        return "not submitted", []
    return ("not finished" if state.mlflow in ("-", "FINISHED") else state.mlflow.lower()), []


def launched_plan(experiment: str, overrides: list[str]) -> Plan:
    """The plan of the experiment's last launch when no overrides are given, else the plan of the overrides."""
    if not overrides:
        probe = plan_experiment(experiment, [])
        cfg = probe.runs[0].config
        manifest = latest_manifest(cfg.paths.runs, experiment, cfg.tracking.uri)
        if manifest is not None and (manifest["overrides"] or manifest.get("extra_seeds")):
            return plan_experiment(experiment, manifest["overrides"], manifest.get("extra_seeds"))
        return probe
    return plan_experiment(experiment, overrides)


def experiment_status(experiment: str, overrides: list[str], plan: Plan | None = None) -> list[RunStatus]:
    plan = plan or launched_plan(experiment, overrides)
    cfg0 = plan.runs[0].config
    sources = Sources(cfg0.paths.runs, experiment, cfg0.tracking.uri, plan.overrides)
    stopped = stopped_keys(plan)
    out = []
    for planned in plan.runs:
        r = sources.mlflow.get(planned.key)
        entry = sources.jobs.get(planned.key, {})
        job_id = r.data.tags.get(schema.TAG_SLURM_JOB, entry.get("job_id", "-")) if r else entry.get("job_id", "-")
        job_state = sources.states.get(entry.get("job_id", ""), "-") if entry.get("scheduler") == "slurm" else (
            LOCAL if entry else "-")
        latest = checkpoint.latest(planned.run_dir.path)
        state = state_of(planned, sources)
        out.append(RunStatus(
            planned.key, planned.name, planned.role.value, state.mlflow, job_id, job_state,
            int(latest.name.split("_")[-1]) if latest else None,
            r.data.metrics.get(schema.VAL_LOSS) if r else None,
            int(r.data.tags.get(schema.TAG_RESTARTS, "0")) if r else 0,
            _verdict(planned, state, job_state, bool(entry), stopped.get(planned.key)), state,
        ))
    return out


def print_status(rows: list[RunStatus], title: str) -> None:
    from study.console import console
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for s in rows:
        table.add_row(s.key, s.name, s.role, s.mlflow, s.job_id, s.job_state,
                      str(s.last_step) if s.last_step is not None else "-",
                      f"{s.val_loss:.4f}" if s.val_loss is not None else "-", str(s.restarts), s.verdict)
    console().print(table)
    counts = Counter(s.verdict.split(" (")[0] for s in rows)
    console().print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
