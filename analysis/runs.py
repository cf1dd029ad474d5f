"""Read an experiment's training runs from MLflow into one pandas row per run.

Finals come from one paged ``search_runs`` query: MLflow keeps each metric's latest value (largest step, then
latest timestamp), which is exactly the "final" the schema defines. Curves cost one metric-history call per run,
so they are read only when a plot needs them.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterable

import pandas as pd

from study.errors import StudyError
from study.track.store import mlflow_client, sqlite_path
from study.track.groups import GROUP_STAGE
from study.track.query import all_runs, read_manifest_tags
from study.track.store import resolve_tracking_uri

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

REPORT_STAGE = "report"
"""Value of the ``study.stage`` tag that marks experiment-level report runs (not training runs)."""

FINISHED = "FINISHED"
"""MLflow status of a run that ended normally; only these enter the statistics."""

_REQUIRED_TAGS = ("study.variant", "study.scale", "study.seed")
_SCALE_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def client(uri: str | None = None) -> MlflowClient:
    """An MlflowClient on the store training uses (argument, else ``MLFLOW_TRACKING_URI``, else ./mlflow.db).

    Reading must not create an empty SQLite store at a mistyped path, so a missing database file is an error.
    """
    resolved = resolve_tracking_uri(uri or "")
    db = sqlite_path(resolved)
    if db is not None and not db.exists():
        raise StudyError(
            "tracking_uri",
            f"no MLflow store at {db}",
            "run the experiment first, or point MLFLOW_TRACKING_URI (or tracking_uri) at the store that holds it",
        )
    return mlflow_client(resolved)


def experiment_id(store: MlflowClient, experiment: str) -> str:
    """The id of the experiment named ``experiment``; a StudyError listing the names present otherwise."""
    found = store.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(e.name for e in store.search_experiments())
        raise StudyError(
            "experiment",
            f"no MLflow experiment named {experiment!r}",
            f"choose one of: {', '.join(names) or '(the store has no experiments yet)'}",
        )
    return found.experiment_id


def read_runs(experiment: str, tracking_uri: str | None = None) -> pd.DataFrame:
    """One row per training run of ``experiment``, unfinished ones included with their status.

    Columns: run_id, run_name, run_key, variant, scale, seed (int), stage, baseline, status, failure_reason,
    start_time, params_counted (int or NaN), then one column per final metric named by its MLflow key
    (``val/loss``, ``eval/arc_easy/acc``, ...).
    Report runs (``study.stage=report``), parent runs (``study.stage=group``) and runs without the study's variant/scale/seed tags are not training
    runs and are left out; when `study launch` recorded a manifest, only the last launch's runs are kept.
    """
    store = client(tracking_uri)
    exp_id = experiment_id(store, experiment)
    rows = [_row(run) for run in all_runs(store, exp_id)]
    rows = [row for row in rows if row is not None]
    manifest = read_manifest_tags(store, experiment)
    if manifest is not None and manifest["keys"]:
        # the experiment's last launch decides which runs the report is about (earlier launches may linger)
        launched = set(manifest["keys"])
        rows = [row for row in rows if row["run_key"] in launched]
    if not rows:
        raise StudyError(
            "experiment",
            f"MLflow experiment {experiment!r} holds no training runs",
            f"launch it first (`study launch {experiment}`), then report",
        )
    frame = pd.DataFrame(rows)
    fixed = [c for c in frame.columns if "/" not in c]
    metrics = sorted(c for c in frame.columns if "/" in c)
    return frame[fixed + metrics].sort_values(["scale", "variant", "seed"], ignore_index=True)


def _row(run) -> dict | None:
    tags = run.data.tags
    if tags.get("study.stage") in (REPORT_STAGE, GROUP_STAGE) or any(t not in tags for t in _REQUIRED_TAGS):
        return None
    counted = run.data.params.get("params.counted")
    row = {
        "run_id": run.info.run_id,
        "run_name": run.info.run_name,
        "run_key": tags.get("study.run_key"),
        "variant": tags["study.variant"],
        "scale": tags["study.scale"],
        "seed": int(tags["study.seed"]),
        "stage": tags.get("study.stage"),
        "baseline": tags.get("study.baseline"),
        "status": run.info.status,
        "failure_reason": tags.get("study.failure_reason"),
        "start_time": run.info.start_time,
        "params_counted": int(float(counted)) if counted not in (None, "", "None") else math.nan,
    }
    row.update(run.data.metrics)
    return row


def read_curves(
    run_ids: Iterable[str], metric: str = "val/loss", tracking_uri: str | None = None, workers: int = 4
) -> pd.DataFrame:
    """Full history of ``metric`` for each run, long form: columns run_id, step, value.

    A few threads overlap the per-run round trips, which matters against a tracking server over HTTP.
    """
    store = client(tracking_uri)
    ids = list(run_ids)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        histories = list(pool.map(lambda rid: store.get_metric_history(rid, metric), ids))
    records = [
        (rid, m.step, m.value, m.timestamp) for rid, history in zip(ids, histories, strict=True) for m in history
    ]
    curves = pd.DataFrame(records, columns=["run_id", "step", "value", "timestamp"])
    # A resumed run can re-log a step; its latest value wins, as it does for the final.
    curves = curves.sort_values("timestamp").drop_duplicates(["run_id", "step"], keep="last")
    return curves.drop(columns="timestamp").sort_values(["run_id", "step"], ignore_index=True)


def scale_order(runs: pd.DataFrame) -> list[str]:
    """Scales from small to large: by median counted parameters, else by the size in the name, else by name."""

    def key(scale: str) -> tuple[float, float, str]:
        counted = runs.loc[runs["scale"] == scale, "params_counted"].median()
        match = re.search(r"(\d+(?:\.\d+)?)\s*([kmbgt]?)", scale.lower())
        from_name = float(match.group(1)) * _SCALE_SUFFIX[match.group(2)] if match else math.inf
        return (counted if pd.notna(counted) else math.inf, from_name, scale)

    return sorted(runs["scale"].unique(), key=key)
