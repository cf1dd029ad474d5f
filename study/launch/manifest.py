"""The launch manifest: what `study launch` launched (experiment, overrides, every run key), so `study status`,
`study report` and a relaunch find the launched runs without the user repeating the overrides. Kept twice: a line
per launch in <runs>/<experiment>/_launch/manifest.jsonl, and the latest launch in the MLflow experiment's tags."""

from __future__ import annotations

import time
from pathlib import Path

from study.files import COUNT, TEXT, TEXTS, read_json_lines, shape_problem
from study.launch.scheduler import append_lines
from study.schema import launch_dir, not_a_link


def manifest_path(runs_root: str | Path, experiment: str) -> Path:
    return not_a_link(launch_dir(runs_root, experiment) / "manifest.jsonl")


def write_manifest(runs_root: str | Path, experiment: str, overrides: list[str], keys: list[str],
                   tracking_uri: str = "", extra_seeds: dict | None = None) -> None:
    from study.config.secrets import redact
    from study.track.query import write_manifest_tags
    from study.track.store import check_answers, get_or_create_experiment, mlflow_client, resolve_tracking_uri

    # the masked form, here and in the MLflow tags: an override may carry a secret (`cluster.setup=[...--token X]`)
    entry = {"experiment": experiment, "overrides": redact(list(overrides)), "keys": list(keys), "time": time.time()}
    if extra_seeds:
        entry["extra_seeds"] = extra_seeds  # seeds an adaptive launch added, per scale and variant
    path = manifest_path(runs_root, experiment)
    uri = resolve_tracking_uri(tracking_uri)
    check_answers(uri)  # before the line is written: a launch refused for its store leaves no manifest behind
    append_lines(path, [entry])
    client = mlflow_client(uri)
    write_manifest_tags(client, get_or_create_experiment(client, uri, experiment), entry)


def latest_manifest(runs_root: str | Path, experiment: str, tracking_uri: str = "") -> dict | None:
    """The latest launch of the experiment: the local manifest, else the MLflow experiment's tags."""
    path = manifest_path(runs_root, experiment)
    launches = read_json_lines(path, f"delete the damaged line of {path}, or the whole file: the MLflow experiment's "
                               "tags keep the latest launch", _launch_problem)
    if launches:
        return launches[-1]
    from study.track.query import open_store, read_manifest_tags

    client = open_store(tracking_uri)
    return None if client is None else read_manifest_tags(client, experiment)


def _launch_problem(entry) -> str:
    """What keeps a line of the manifest from being a launch ('' when nothing)."""
    problem = shape_problem(entry, {"experiment": TEXT, "overrides": TEXTS, "keys": TEXTS})
    if problem:
        return problem
    seeds = entry.get("extra_seeds", {})  # scale -> variant -> seeds an adaptive launch added
    if not (isinstance(seeds, dict) and all(isinstance(per, dict) and all(
            isinstance(s, list) and all(COUNT.holds(x) for x in s) for s in per.values()) for per in seeds.values())):
        return f"has `extra_seeds` {seeds!r:.60}, not seeds per scale and variant"
    return ""


def new_runs(keys: list[str], manifest: dict | None) -> list[str]:
    """Planned keys the last launch did not launch (none when nothing was launched before)."""
    if manifest is None:
        return []
    launched = set(manifest["keys"])
    return [k for k in keys if k not in launched]
