"""`study status`: every planned run of an experiment with its MLflow state and its scheduler's view of it."""

from __future__ import annotations

from dataclasses import dataclass

from study import checkpoint
from study.launch import ACTIVE, journal, slurm_states
from study.plan import plan_experiment, run_dir

DEAD = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
        "VANISHED"}


@dataclass
class RunStatus:
    key: str
    name: str
    stage: str
    mlflow: str
    """MLflow run status, or `-` when the run never started."""
    job_id: str
    job_state: str
    last_step: int | None
    val_loss: float | None
    restarts: int
    verdict: str
    """One word a person acts on: finished, running, queued, failed, died, not submitted."""


def _verdict(mlflow: str, job_state: str, submitted: bool) -> str:
    if mlflow == "FINISHED":
        return "finished"
    if job_state in ACTIVE:
        return "queued" if job_state == "PENDING" else "running"
    if mlflow == "FAILED":
        return "failed"
    if mlflow == "RUNNING" and job_state in DEAD:
        return f"died ({job_state.lower()}, no word from the run)"
    if submitted and job_state in DEAD:
        return f"died ({job_state.lower()})"
    return "not submitted" if not submitted else (mlflow.lower() if mlflow != "-" else "not started")


def experiment_status(experiment: str, overrides: list[str]) -> list[RunStatus]:
    from study.mlflow_store import mlflow_client
    from study.tracking import resolve_tracking_uri

    plan = plan_experiment(experiment, overrides)
    cfg0 = plan.runs[0].cfg
    client = mlflow_client(resolve_tracking_uri(cfg0.tracking.uri))
    exp = client.get_experiment_by_name(experiment)
    runs = {}
    if exp is not None:
        for r in client.search_runs([exp.experiment_id], max_results=5000):
            if "study.run_key" in r.data.tags:
                runs[r.data.tags["study.run_key"]] = r
    jobs = journal(plan)
    states = slurm_states([e["job_id"] for e in jobs.values() if e.get("scheduler") == "slurm"])
    out = []
    for planned in plan.runs:
        r = runs.get(planned.key)
        entry = jobs.get(planned.key, {})
        job_id = r.data.tags.get("study.slurm_job_id", entry.get("job_id", "-")) if r else entry.get("job_id", "-")
        job_state = states.get(entry.get("job_id", ""), "-") if entry.get("scheduler") == "slurm" else (
            "local" if entry else "-")
        latest = checkpoint.latest(run_dir(planned.cfg, planned.key))
        mlflow = r.info.status if r else "-"
        out.append(RunStatus(
            planned.key, planned.name, planned.cfg.stage, mlflow, job_id, job_state,
            int(latest.name.split("_")[-1]) if latest else None,
            r.data.metrics.get("val/loss") if r else None,
            int(r.data.tags.get("study.restarts", "0")) if r else 0,
            _verdict(mlflow, job_state, bool(entry)),
        ))
    return out


def print_status(rows: list[RunStatus], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("run key", "run", "stage", "MLflow", "job", "SLURM", "ckpt step", "val/loss", "restarts", "state"):
        table.add_column(col)
    for s in rows:
        table.add_row(s.key, s.name, s.stage, s.mlflow, s.job_id, s.job_state,
                      str(s.last_step) if s.last_step is not None else "-",
                      f"{s.val_loss:.4f}" if s.val_loss is not None else "-", str(s.restarts), s.verdict)
    Console(width=200).print(table)
    counts: dict[str, int] = {}
    for s in rows:
        word = s.verdict.split(" (")[0]
        counts[word] = counts.get(word, 0) + 1
    Console().print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
