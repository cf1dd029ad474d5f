"""`study status`: every launched run of an experiment with its MLflow state and its scheduler's view of it.

Without overrides the runs are those of the experiment's last launch (its manifest), so a sweep launched with
`train.lr=...` or `cluster=h100` shows as launched without repeating them.
"""

from __future__ import annotations

from dataclasses import dataclass

from study import schema
from study.launch.manifest import latest_manifest
from study.launch.scheduler import ACTIVE, DEAD, STUCK, job_states, journal
from study.plan.planner import Plan, plan_experiment
from study.track.query import runs_by_key
from study.train import checkpoint


LOCAL = "local process"
COLUMNS = ("run key", "run", "stage", "MLflow status", "job id", "scheduler state", "checkpoint step",
           "val/loss (last)", "restarts", "state")
"""`study status` columns: `scheduler state` is SLURM's view of the job (or `local process`), `state` the one word
to act on, from MLflow and the scheduler together."""


@dataclass
class RunStatus:
    key: str
    name: str
    stage: str
    mlflow: str
    """MLflow run status, or `-` when the run never started."""
    job_id: str
    """SLURM job id (`<array>_<task>` for an array task), or the local process id, `-` when never submitted."""
    job_state: str
    """What the scheduler says now: a SLURM state (PENDING, RUNNING, COMPLETED, ...), DEPENDENCY_NEVER_SATISFIED for a
    job that can never start, `local process` for a run the launcher ran on this machine (no queue keeps its state),
    `-` when never submitted."""
    last_step: int | None
    val_loss: float | None
    restarts: int
    verdict: str
    """One word a person acts on: finished, running, queued, stuck, failed, died, not submitted, waiting for its
    tuning."""


def _verdict(mlflow: str, job_state: str, submitted: bool) -> str:
    if mlflow == "FINISHED":
        return "finished"
    if job_state == STUCK:
        return "stuck (a job it waits for failed or was cancelled, so it never starts; `study launch` resubmits it)"
    if job_state in ACTIVE:
        return "queued" if job_state == "PENDING" else "running"
    if mlflow == "FAILED":
        return "failed"
    if mlflow == "RUNNING" and job_state in DEAD:
        return f"died ({job_state.lower()}, no word from the run)"
    if submitted and job_state in DEAD:
        return f"died ({job_state.lower()})"
    return "not submitted" if not submitted else (mlflow.lower() if mlflow != "-" else "not started")


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
    runs = runs_by_key(experiment, cfg0.tracking.uri)
    jobs = journal(cfg0.paths.runs, experiment)
    states = job_states(jobs)
    out = []
    for planned in plan.runs:
        r = runs.get(planned.key)
        entry = jobs.get(planned.key, {})
        job_id = r.data.tags.get(schema.TAG_SLURM_JOB, entry.get("job_id", "-")) if r else entry.get("job_id", "-")
        job_state = states.get(entry.get("job_id", ""), "-") if entry.get("scheduler") == "slurm" else (
            LOCAL if entry else "-")
        latest = checkpoint.latest(planned.run_dir.path)
        mlflow = r.info.status if r else "-"
        out.append(RunStatus(
            planned.key, planned.name, planned.stage, mlflow, job_id, job_state,
            int(latest.name.split("_")[-1]) if latest else None,
            r.data.metrics.get(schema.VAL_LOSS) if r else None,
            int(r.data.tags.get(schema.TAG_RESTARTS, "0")) if r else 0,
            "waiting for its tuning" if planned.awaits_tuning and not entry
            else _verdict(mlflow, job_state, bool(entry)),
        ))
    return out


def print_status(rows: list[RunStatus], title: str) -> None:
    from study.console import console
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col)
    for s in rows:
        table.add_row(s.key, s.name, s.stage, s.mlflow, s.job_id, s.job_state,
                      str(s.last_step) if s.last_step is not None else "-",
                      f"{s.val_loss:.4f}" if s.val_loss is not None else "-", str(s.restarts), s.verdict)
    console().print(table)
    counts: dict[str, int] = {}
    for s in rows:
        word = s.verdict.split(" (")[0]
        counts[word] = counts.get(word, 0) + 1
    console().print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
