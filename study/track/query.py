"""Reading an experiment back from MLflow, in one place: every run (paged), runs by run key, and the launch manifest
kept in the experiment's tags. `study launch`, `study status` and the report all read through here."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

from study import schema
from study.config.tracking import TrackingConfig
from study.errors import StudyError
from study.track.store import (call_with_retries, check_answers, is_locked, mlflow_client, oldest_first,
                               resolve_tracking_uri, short, sqlite_path)

T = TypeVar("T")

PAGE = 1000
KEYS_PER_TAG = 300
"""Run keys per experiment tag: 300 x 13 characters stays under MLflow's 5,000-character tag values."""


def open_store(tracking_uri: str = "", required: bool = False):
    """A client on the store (argument, else ``MLFLOW_TRACKING_URI``, else ./mlflow.db), waited for while busy. Reading
    never creates a store: a missing SQLite file gives None, or StudyError when `required`; a silent server is
    refused at once (`check_answers`)."""
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        if required:
            raise StudyError("tracking_uri", f"no MLflow store at {db}",
                             "run the experiment first, or point MLFLOW_TRACKING_URI (or tracking_uri) at the store "
                             "that holds it")
        return None
    check_answers(uri)
    return read(lambda: mlflow_client(uri), uri, "connect")


def runs_with_role(client, experiment_ids: list[str], role: str, where: str = "", order_by: list[str] | None = None,
                   max_results: int = 100) -> list:
    """Runs of this role (tag `study.role`, and `where`, an MLflow filter); in a store written before that tag, the
    runs its older tag (`study.stage`) gives this role."""
    for tag in (schema.TAG_ROLE, schema.OLD_TAG_ROLE):
        found = client.search_runs(experiment_ids, " and ".join(f for f in (f"tags.`{tag}` = '{role}'", where) if f),
                                   order_by=order_by or [], max_results=max_results)
        if found:
            return found
    return []


def read(fn: Callable[[], T], uri: str, what: str) -> T:
    """`fn()` on the store, retried (for the default tracking.open_timeout_s) only while a writer holds an SQLite store
    locked: a reader is a person at a prompt or a plan that must not stall."""
    cfg = TrackingConfig()
    with readable(uri):
        return call_with_retries(fn, cfg, time.monotonic() + cfg.open_timeout_s, f"read ({what})", is_locked)


@contextmanager
def readable(uri: str):
    """A store that cannot be read (a damaged or half-migrated SQLite file, a server that refuses) is bad input."""
    try:
        yield
    except StudyError:
        raise
    except Exception as exc:
        raise StudyError("tracking.uri", f"the MLflow store {uri} cannot be read ({short(exc)})",
                         "point MLFLOW_TRACKING_URI (or tracking.uri) at a working store; a damaged SQLite file can "
                         "be moved away and the runs replayed from their run directories by training them "
                         "again") from None


def experiment_of(client, experiment: str):
    return None if client is None else client.get_experiment_by_name(experiment)


def all_runs(client, experiment_id: str, filter_string: str = "") -> list:
    """Every run of the experiment, page by page (MLflow's own pager)."""
    from mlflow.utils import get_results_from_paginated_fn

    return get_results_from_paginated_fn(lambda n, token: client.search_runs(
        [experiment_id], filter_string=filter_string, max_results=n, page_token=token), PAGE)


def runs_by_key(experiment: str, tracking_uri: str = "") -> dict[str, object]:
    """The MLflow run of each run key in the experiment (the oldest when a race left two)."""
    client = open_store(tracking_uri)

    def listed() -> list:
        exp = experiment_of(client, experiment)
        return [] if exp is None else list(all_runs(client, exp.experiment_id))

    runs = read(listed, resolve_tracking_uri(tracking_uri), "runs")
    out: dict[str, object] = {}
    for run in oldest_first(runs):
        key = run.data.tags.get(schema.TAG_RUN_KEY)
        if key and key not in out:
            out[key] = run
    return out


def write_manifest_tags(client, experiment_id: str, entry: dict) -> None:
    """The latest launch in the experiment's tags: overrides and time in `study.launch`, keys in chunks."""
    keys = entry["keys"]
    chunks = [keys[i:i + KEYS_PER_TAG] for i in range(0, len(keys), KEYS_PER_TAG)] or [[]]
    head = {k: v for k, v in entry.items() if k != "keys"}
    client.set_experiment_tag(experiment_id, schema.TAG_LAUNCH, json.dumps({**head, "chunks": len(chunks)}))
    for i, chunk in enumerate(chunks):
        client.set_experiment_tag(experiment_id, f"{schema.TAG_LAUNCH_KEYS}.{i}", ",".join(chunk))


def read_manifest_tags(client, experiment: str) -> dict | None:
    """The latest launch recorded in the experiment's tags, or None."""
    exp = read(lambda: experiment_of(client, experiment), str(getattr(client, "tracking_uri", "")), "experiment")
    if exp is None or schema.TAG_LAUNCH not in exp.tags:
        return None
    head = json.loads(exp.tags[schema.TAG_LAUNCH])
    keys: list[str] = []
    for i in range(int(head.pop("chunks", 0))):
        keys += [k for k in exp.tags.get(f"{schema.TAG_LAUNCH_KEYS}.{i}", "").split(",") if k]
    return {**head, "keys": keys}
