"""The launch manifest: what `study launch` launched (experiment, overrides, every run key), so `study status`,
`study report` and a relaunch find the launched runs without the user repeating the overrides.

Kept twice: appended to <runs>/<experiment>/_launch/manifest.jsonl (one line per launch) and, for the latest launch,
in the MLflow experiment's tags (readable from any machine that sees the tracking server).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from study.errors import StudyError
from study.launch.scheduler import append_lines
from study.schema import launch_dir, not_a_link


def manifest_path(runs_root: str | Path, experiment: str) -> Path:
    return not_a_link(launch_dir(runs_root, experiment) / "manifest.jsonl")


def write_manifest(runs_root: str | Path, experiment: str, overrides: list[str], keys: list[str],
                   tracking_uri: str = "", extra_seeds: dict | None = None) -> None:
    from study.config.secrets import redact

    # the masked form, here and in the MLflow tags: an override may carry a secret (`cluster.setup=[...--token X]`)
    entry = {"experiment": experiment, "overrides": redact(list(overrides)), "keys": list(keys), "time": time.time()}
    if extra_seeds:
        entry["extra_seeds"] = extra_seeds  # seeds an adaptive launch added, per scale and variant
    path = manifest_path(runs_root, experiment)
    from study.track.query import write_manifest_tags
    from study.track.store import check_answers, get_or_create_experiment, mlflow_client, resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    check_answers(uri)  # before the line is written: a launch refused for its store leaves no manifest behind
    append_lines(path, [entry])
    client = mlflow_client(uri)
    write_manifest_tags(client, get_or_create_experiment(client, uri, experiment), entry)


def latest_manifest(runs_root: str | Path, experiment: str, tracking_uri: str = "") -> dict | None:
    """The latest launch of the experiment: the local manifest, else the MLflow experiment's tags."""
    path = manifest_path(runs_root, experiment)
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if lines:
            try:
                return json.loads(lines[-1])
            except json.JSONDecodeError:
                raise StudyError(str(path), "is not a launch manifest (its last line is not JSON)",
                                 "remove the damaged line; the MLflow experiment's tags keep the latest launch") from None
    from study.track.query import open_store, read_manifest_tags

    client = open_store(tracking_uri)
    return None if client is None else read_manifest_tags(client, experiment)


def new_runs(keys: list[str], manifest: dict | None) -> list[str]:
    """Planned keys the last launch did not launch (none when nothing was launched before)."""
    if manifest is None:
        return []
    launched = set(manifest["keys"])
    return [k for k in keys if k not in launched]
