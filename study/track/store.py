"""The MLflow side of tracking, synchronous: store URIs, SQLite first-use locking, retries, finding or resuming a run
(`study.track.tracker.Tracker` keeps it off the training step's path)."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from study import schema
from study.config.data import study_cache
from study.config.identity import json_digest
from study.config.secrets import mask_text
from study.config.tracking import TrackingConfig
from study.errors import StudyError
from study.files import file_lock, replace_file

log = logging.getLogger(__name__)
T = TypeVar("T")

# MLflow's limit on characters per param value.
MAX_PARAM_CHARS = 6000
_TRANSIENT_CODES = frozenset({"TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED",
                              "DEADLINE_EXCEEDED", "ABORTED"})
_PERMANENT_ERRNOS = frozenset({errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
                               errno.EEXIST})


def resolve_tracking_uri(uri: str = "") -> str:
    """`uri` if given, else $MLFLOW_TRACKING_URI, else an absolute SQLite store in the working directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


PROBE_TIMEOUT_S = 5.0
"""How long a tracking server may take to answer its first contact before the URI is refused (MLflow's own retries
take about four minutes)."""


def check_answers(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuses an http(s) tracking URI whose server does not answer one `/health` request (MLflow's credentials and
    TLS settings, no retries) within `timeout_s`; any answer counts, an error status too. Local stores pass."""
    if not re.match(r"(?i)https?://", uri):
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        http_request(get_default_host_creds(uri), "/health", "GET", max_retries=0, backoff_factor=0,
                     backoff_jitter=0, timeout=timeout_s, raise_on_status=False)
    except Exception as exc:  # noqa: BLE001  (MLflow wraps whatever requests raised in its own text)
        refused = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(exc))
        reason = (f"no answer within {timeout_s:g} s" if re.search(r"(?i)timed? ?out", str(exc)) else
                  refused[1].strip().lower() if refused else
                  # a server that accepts and hangs up: the client sees the close, or a reset, by how fast it read
                  "it closed the connection without a reply" if re.search(
                      r"RemoteDisconnected|ConnectionResetError|reset by peer", str(exc)) else
                  mask_text(short(exc)))
        raise StudyError("tracking.uri", f"the MLflow server {mask_text(uri)} does not answer ({reason})",
                         "start the tracking server (`mlflow server`), or point tracking.uri (or MLFLOW_TRACKING_URI) "
                         "at a reachable store") from None


def sqlite_path(uri: str) -> Path | None:
    """The database file of an `sqlite:///` URI (relative paths resolve against the working directory), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path).resolve()


def read_per_version(uri: str, what: list, read: Callable[[], T]) -> T:
    """`read()`'s JSON answer about the store at `uri` (the question `what`), kept in study's cache until the SQLite
    file or its WAL changes size or mtime: importing MLflow costs a plan about 3 s. A server is asked every time."""
    db = sqlite_path(resolve_tracking_uri(uri))
    if db is None or not db.exists():
        return read()
    version = [[st.st_size, st.st_mtime_ns] for st in (p.stat() for p in (db, db.with_name(db.name + "-wal"))
                                                       if p.exists())]
    kept = study_cache() / "store-reads" / f"{json_digest([str(db), what], 20)}.json"
    with suppress(OSError, ValueError, KeyError, TypeError):  # a kept answer that cannot be read is asked again
        held = json.loads(kept.read_text())
        if held["version"] == version:
            return held["answer"]
    answer = read()
    with suppress(OSError):  # an unwritable cache only costs the next plan the read
        kept.parent.mkdir(parents=True, exist_ok=True)
        replace_file(kept, json.dumps({"version": version, "answer": answer}))
    return answer


def artifact_location(uri: str, experiment: str) -> str | None:
    """`mlartifacts/<experiment>` next to an SQLite store; None (the store decides) for others."""
    db = sqlite_path(uri)
    if db is None:
        return None
    return (db.parent / "mlartifacts" / re.sub(r"[^\w.-]+", "_", experiment)).as_uri()


def is_locked(exc: BaseException) -> bool:
    """Whether a call failed because another connection held the SQLite store locked past SQLite's own wait."""
    return "database is locked" in str(exc) or "database table is locked" in str(exc)


def is_transient(exc: BaseException) -> bool:
    """Whether a failed MLflow call may succeed later (outage, overload, SQLite lock) rather than being rejected."""
    if is_locked(exc):
        return True
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        return exc.error_code in _TRANSIENT_CODES
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return False  # a missing directory or a read-only file system does not heal by waiting
    if "unable to open database file" in str(exc) or "readonly database" in str(exc):
        return False
    return isinstance(exc, (OSError, TimeoutError))


def short(exc: BaseException) -> str:
    """The first line of an error, for one-line log messages (MLflow's errors can run to pages)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]


def jittered(delay: float) -> float:
    # Jitter de-synchronises processes that hit the same SQLite lock or the same restarted server together.
    return delay * random.uniform(0.5, 1.5)


def call_with_retries(fn: Callable[[], T], cfg: TrackingConfig, deadline: float, what: str,
                      retry_on: Callable[[BaseException], bool] = is_transient) -> T:
    """`fn()`, retried with jittered exponential backoff on errors `retry_on` accepts until `deadline` (monotonic)."""
    delay = cfg.retry_initial_s
    while True:
        try:
            return fn()
        except Exception as exc:
            wait = jittered(delay)
            if not retry_on(exc) or time.monotonic() + wait > deadline:
                raise
            log.warning("MLflow %s failed (%s); retrying in %.1f s", what, short(exc), wait)
            time.sleep(wait)
            delay = min(2 * delay, cfg.retry_max_s)


def mlflow_client(uri: str):
    """An `MlflowClient` for `uri`. An SQLite store is opened under a cross-process lock, as MLflow creates its tables
    on first use and creators collide; an existing store in a folder this process cannot write is opened without the
    lock: it can create nothing there."""
    from mlflow import MlflowClient

    db = sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401  (a 2 s import: done before taking the lock)

    with ExitStack() as held:
        try:
            held.enter_context(file_lock(db.with_name(db.name + ".lock")))
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not db.is_file():
                raise
        return MlflowClient(tracking_uri=uri)


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""MLflow 3's UI opens an experiment without this tag in its GenAI view (traces); with it, in the runs table."""


def get_or_create_experiment(client, uri: str, name: str) -> str:
    """The id of experiment `name`, created (`artifact_location`, `EXPERIMENT_KIND`) or restored if needed."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        from mlflow.exceptions import MlflowException

        try:
            return client.create_experiment(name, artifact_location=artifact_location(uri, name),
                                            tags=EXPERIMENT_KIND)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)  # another process created it meanwhile
    if experiment.lifecycle_stage == "deleted":
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


def find_runs(client, experiment_id: str, run_key: str) -> list:
    """Active runs tagged with `run_key`, oldest first (the first is the run; others are duplicates from a race)."""
    return oldest_first(client.search_runs([experiment_id], filter_string=f"tags.`{schema.TAG_RUN_KEY}` = '{run_key}'",
                                           max_results=100))


def oldest_first(runs: list) -> list:
    """Runs by start time (then id): the first of a race's duplicates is the one every process keeps."""
    return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))


def params_to_log(existing: Mapping[str, str], params: Mapping[str, str]) -> dict[str, str]:
    """Params not yet on the run; one already there with another value means the run key did not pin the config."""
    wanted = {k: v[:MAX_PARAM_CHARS] for k, v in params.items()}
    clashes = {k: (existing[k], v) for k, v in wanted.items() if k in existing and existing[k] != v}
    if clashes:
        listed = "; ".join(f"{k}: logged {old!r}, now {new!r}" for k, (old, new) in sorted(clashes.items()))
        raise ValueError(f"params differ from the ones already logged for this run key: {listed}")
    return {k: v for k, v in wanted.items() if k not in existing}


def open_run(client, experiment_id: str, run_key: str, run_name: str, tags: Mapping[str, str],
             params: Mapping[str, str]) -> tuple:
    """The run for `run_key` and the params it still lacks: resumed (RUNNING again, `study.restarts` + 1) if it
    exists, else created. Params are checked against the existing run before anything about it changes."""
    from mlflow.entities import RunTag

    tags = {**tags, schema.TAG_RUN_KEY: run_key}
    runs = find_runs(client, experiment_id, run_key)
    if runs:
        run_id, old_tags = runs[0].info.run_id, runs[0].data.tags
        missing = params_to_log(runs[0].data.params, params)
        client.update_run(run_id, status="RUNNING")
        if schema.TAG_FAILURE_REASON in old_tags:
            client.delete_tag(run_id, schema.TAG_FAILURE_REASON)
        tags[schema.TAG_RESTARTS] = str(int(old_tags.get(schema.TAG_RESTARTS, "0")) + 1)
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()], synchronous=True)
        return client.get_run(run_id), missing
    client.create_run(experiment_id, run_name=run_name, tags={**tags, schema.TAG_RESTARTS: "0"})
    # Two creators racing (or a create retried after a lost reply) leave duplicates: all keep the oldest.
    runs = find_runs(client, experiment_id, run_key)
    for duplicate in runs[1:]:
        client.delete_run(duplicate.info.run_id)
    return runs[0], params_to_log(runs[0].data.params, params)


@contextmanager
def connected(cfg: TrackingConfig) -> Iterator[tuple[Any, str, float]]:
    """(client, URI, deadline) for `cfg`'s store, retried until `cfg.open_timeout_s`; a store that refuses the block's
    calls, or does not answer in time, is refused naming tracking.uri."""
    uri = resolve_tracking_uri(cfg.uri)
    deadline = time.monotonic() + cfg.open_timeout_s
    try:
        yield call_with_retries(lambda: mlflow_client(uri), cfg, deadline, "connect"), uri, deadline
    except StudyError:
        raise
    except Exception as exc:
        if not is_transient(exc):
            if isinstance(exc, OSError) or "database" in str(exc).lower():
                raise StudyError("tracking.uri", f"the MLflow store {uri} cannot be used ({short(exc)})",
                                 "point tracking.uri (or MLFLOW_TRACKING_URI) at a writable store; a damaged "
                                 "SQLite file can be moved away and the runs replayed from their run "
                                 "directories") from None
            raise
        raise StudyError("tracking.uri", f"the MLflow store {uri} did not answer within {cfg.open_timeout_s:.0f} s "
                         f"({short(exc)})", "start the tracking server, or point MLFLOW_TRACKING_URI at a reachable "
                         "store") from exc


def retire_runs(run_key: str, experiment: str, cfg: TrackingConfig, note: str) -> list[str]:
    """Sets aside (and returns the ids of) every MLflow run of `run_key`, for a run trained again from step 0: tagged
    schema.TAG_REPLACED with `note`, ended KILLED if RUNNING, soft-deleted. A metric history cannot be deleted, so the
    next `Tracker.open` creates a fresh run for the new curve."""
    with connected(cfg) as (client, _, deadline):
        found = call_with_retries(lambda: client.get_experiment_by_name(experiment), cfg, deadline, "experiment")
        runs = [] if found is None else call_with_retries(
            lambda: find_runs(client, found.experiment_id, run_key), cfg, deadline, "find run")
        for run in runs:
            run_id = run.info.run_id
            call_with_retries(lambda: client.set_tag(run_id, schema.TAG_REPLACED, note), cfg, deadline, "tag")
            if run.info.status == "RUNNING":
                call_with_retries(lambda: client.set_terminated(run_id, "KILLED"), cfg, deadline, "end")
            call_with_retries(lambda: client.delete_run(run_id), cfg, deadline, "delete")
    return [r.info.run_id for r in runs]
