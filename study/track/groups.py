"""Parent runs: one MLflow run per (experiment, variant, scale), its seed runs nested under it (`mlflow.parentRunId`),
so the runs table reads one row per cell.

A parent (`study.role=group`, no seed or run key, so analysis never takes it for a training run) carries the mean,
sample standard deviation and count of its finished seed runs' final metrics under their own names (`val/loss`,
`val/loss/sd`, `val/loss/n`; step = seeds summarised), recomputed whenever one finishes or is evaluated, and their
dataset input. In a branched experiment it summarises the decay branches that end its planned runs, never the trunks,
and the summary goes to the parent alone, never onto a trunk.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping

from study import schema
from study.config.run import Role
from study.track.lineage import DESCRIPTION, PARENT, run_tags
from study.track.query import read_manifest_tags, runs_with_role
from study.track.store import get_or_create_experiment, mlflow_client, oldest_first, resolve_tracking_uri

TAG_GROUP = "study.group"
SUMMARISED = (schema.VAL_LOSS, schema.VAL_PPL)
"""Final metrics a parent summarises, besides every `eval/...` score."""


def group_name(variant: str, scale: str) -> str:
    return f"{variant}-{scale}"


def parent_for(client, experiment_id: str, tags: Mapping[str, str]) -> str:
    """The id of the parent run of a seed run with these `study.*` tags; created if none is found (`study train` on
    its own), the oldest kept and the rest deleted."""
    name = group_name(tags[schema.TAG_VARIANT], tags[schema.TAG_SCALE])
    found = _parents(client, experiment_id, name)
    if not found:
        parent_tags = {TAG_GROUP: name, schema.TAG_ROLE: schema.ROLE_GROUP,
                       schema.TAG_EXPERIMENT: tags.get(schema.TAG_EXPERIMENT, ""),
                       schema.TAG_VARIANT: tags[schema.TAG_VARIANT], schema.TAG_SCALE: tags[schema.TAG_SCALE],
                       schema.TAG_BASELINE: tags.get(schema.TAG_BASELINE, ""),
                       DESCRIPTION: f"{name}: mean, standard deviation (/sd) and count (/n) over its finished seed "
                                    f"runs of {', '.join(SUMMARISED)} and the eval/ scores"}
        run = client.create_run(experiment_id, run_name=name, tags=parent_tags)
        client.set_terminated(run.info.run_id, "FINISHED")
        found = _parents(client, experiment_id, name)
        for duplicate in found[1:]:
            client.delete_run(duplicate.info.run_id)
    return found[0].info.run_id


def ensure_parents(tracking_uri: str, experiment: str, runs) -> None:
    """The parent run of every (variant, scale) of a launch, created before any job starts (jobs would race)."""
    uri = resolve_tracking_uri(tracking_uri)
    client = mlflow_client(uri)
    experiment_id = get_or_create_experiment(client, uri, experiment)
    cells = {group_name(r.config.variant, r.config.scale): r for r in runs}
    for run in cells.values():
        parent_for(client, experiment_id, run_tags(run))


def _parents(client, experiment_id: str, name: str) -> list:
    return oldest_first(runs_with_role(client, [experiment_id], schema.ROLE_GROUP, f"tags.`{TAG_GROUP}` = '{name}'"))


def summary(children: list, keys: set[str] | None = None) -> tuple[dict[str, float], int]:
    """(metrics, n finished): mean, `/sd` (n >= 2) and `/n` of each summarised final metric over the FINISHED
    children that are neither tune runs nor trunks; `keys` limits them to those run keys (the latest launch)."""
    done = [c for c in children if c.info.status == "FINISHED"
            and schema.role_of(c.data.tags) not in (Role.tune, Role.trunk)
            and (keys is None or c.data.tags.get(schema.TAG_RUN_KEY) in keys)]
    values: dict[str, list[float]] = {}
    for child in done:
        for key, value in child.data.metrics.items():
            if (key in SUMMARISED or key.startswith(schema.EVAL_PREFIX)) and math.isfinite(value):
                values.setdefault(key, []).append(value)
    out: dict[str, float] = {}
    for key, vals in sorted(values.items()):
        out[key] = statistics.fmean(vals)
        out[f"{key}/n"] = float(len(vals))
        if len(vals) >= 2:
            out[f"{key}/sd"] = statistics.stdev(vals)
    return out, len(done)


def refresh(client, run_id: str) -> None:
    """Recomputes the summary on the parent of seed run `run_id` (nothing when it has none)."""
    from mlflow.entities import Metric

    run = client.get_run(run_id)
    parent = run.data.tags.get(PARENT)
    if parent and schema.role_of(run.data.tags) == Role.branch:  # nested under its trunk, which the cell's parent holds
        parent = client.get_run(parent).data.tags.get(PARENT)
    if not parent:
        return
    experiment_id = run.info.experiment_id
    children = client.search_runs([experiment_id], filter_string=f"tags.`{PARENT}` = '{parent}'", max_results=1000)
    if any(schema.role_of(c.data.tags) == Role.trunk for c in children):
        children += _planned_ends(client, experiment_id, parent, children)
    manifest = read_manifest_tags(client, client.get_experiment(experiment_id).name)
    keys = set(manifest["keys"]) if manifest and manifest["keys"] else None
    metrics, n = summary(children, keys)
    share_datasets(client, parent, children)
    if metrics:
        now = int(time.time() * 1000)
        points = [Metric(k, v, now, n) for k, v in metrics.items()]
        for i in range(0, len(points), 1000):
            client.log_batch(parent, metrics=points[i:i + 1000], synchronous=True)


def _planned_ends(client, experiment_id: str, parent: str, children: list) -> list:
    """The decay branches as long as their trunk's recipe (its longest branch): what the report decides on. None where
    a race stopped the cell before, so a parent never shows a shorter budget's loss as its cell's."""
    longest = {c.info.run_id: c.data.params.get("recipe.max_steps") for c in children
               if schema.role_of(c.data.tags) == Role.trunk}
    cell = client.get_run(parent).data.tags
    branches = client.search_runs([experiment_id], filter_string=(
        f"tags.`{schema.TAG_ROLE}` = '{Role.branch.value}' and tags.`{schema.TAG_VARIANT}` = "
        f"'{cell.get(schema.TAG_VARIANT)}' and tags.`{schema.TAG_SCALE}` = '{cell.get(schema.TAG_SCALE)}'"),
        max_results=5000)
    return [b for b in branches if b.data.tags.get(PARENT) in longest
            and b.data.params.get("recipe.max_steps") == longest[b.data.tags[PARENT]]]


def share_datasets(client, parent_id: str, children: list) -> None:
    """Log on the parent every dataset input (one per digest) its seed runs carry and it lacks."""
    have = {i.dataset.digest for i in client.get_run(parent_id).inputs.dataset_inputs}
    new = {}
    for child in children:
        for found in child.inputs.dataset_inputs:
            if found.dataset.digest not in have:
                new.setdefault(found.dataset.digest, found)
    if new:
        client.log_inputs(parent_id, datasets=list(new.values()))
