"""MLflow tracking for training runs: one run per run key (the oldest active one), resumed on restart, logged off the
training step's path (`NullTracker` takes the same calls on other ranks). Names are study.schema's: run
`<variant>-<scale>-s<seed>`, tags `study.*`, params flattened with dots (secret keys left out:
`study.config.secrets`), metrics `train/*`, `val/*`, `eval/<task>/<metric>`.

A `log_metric` costs 4.5 ms on SQLite and 30-60 ms over HTTP, a `log_batch` of 1000 points 0.3 s, so
`Tracker.log_metrics` only appends to a buffer that a background thread ships in batches; an outage keeps points
buffered and retried with backoff, and training never waits for MLflow. mlflow is imported inside functions.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from study import schema
from study.config.secrets import ENV_SECTIONS, is_sequence, looks_secret
from study.config.tracking import TrackingConfig
from study.errors import StudyError
from study.files import COUNT, end_cut_line, read_json_lines
from study.track.store import (call_with_retries, connected, find_runs, get_or_create_experiment, is_transient,
                               jittered, open_run, resolve_tracking_uri, short)

logger = logging.getLogger(__name__)
STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow's limits: params per log_batch call, characters per tag value, metric key characters.
PARAMS_PER_CALL = 100
MAX_TAG_CHARS = 8000
_METRIC_KEY = re.compile(r"^[/\w.\- :]{1,250}$")
Point = tuple[str, float, int, int]
"""(key, value, timestamp in ms, step)."""
ARTIFACT_OUTBOX = "artifacts-outbox"
"""Folder of a run directory where artifacts wait until MLflow holds them, each copied into a folder of its own
beside a file naming where it is stored; one the store refused is sent again on the run's next start."""
ARTIFACT_NAME = ".name"
"""File beside a posted artifact holding the name it is stored under."""


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"} for MLflow params, without secret-looking keys and environment sections
    (and all under them). Strings stay as they are, other values are JSON; lists of mappings flatten by index."""
    flat: dict[str, str] = {}
    for raw_key, value in config.items():
        key = str(raw_key)
        if looks_secret(key) or key in ENV_SECTIONS:
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        elif is_sequence(value) and any(isinstance(v, Mapping) for v in value):
            flat.update(flatten({str(i): v for i, v in enumerate(value)}, f"{dotted}."))
        else:
            flat[dotted] = value if isinstance(value, str) else json.dumps(plain(value), default=str)
    return flat


def plain(value: Any) -> Any:
    """OmegaConf containers and tuples -> lists and dicts that json can write (also used for logged dicts)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if is_sequence(value):
        return [plain(v) for v in value]
    return value


def waiting(outbox: Path) -> list[tuple[Path, str]]:
    """The complete artifacts posted to `outbox`, oldest first, as (copied path, name)."""
    found = []
    for folder in sorted(outbox.iterdir(), key=lambda p: p.stat().st_mtime) if outbox.is_dir() else []:
        name_file = folder / ARTIFACT_NAME
        if name_file.is_file():
            name = name_file.read_text()
            found.append((folder / name.rpartition("/")[2], name))
    return found


def post(folder: Path, source: Path | str, name: str) -> tuple[Path, str]:
    """Copy an artifact into `folder` (a Path's file or folder, else `source` as text): (copied path, name)."""
    parts = name.strip("/").split("/")
    if not parts[-1] or ".." in parts:
        raise ValueError(f"artifact name {name!r} must be a relative path to a file")
    copied = Path(tempfile.mkdtemp(dir=folder)) / parts[-1]
    if isinstance(source, Path):
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, copied)
    else:
        copied.write_text(source)
    (copied.parent / ARTIFACT_NAME).write_text("/".join(parts))  # written last: a posted artifact is complete
    return copied, "/".join(parts)


class MetricLog:
    """The run directory's own record of every metric point, `<run dir>/metrics.jsonl`: appended before a point is
    queued for MLflow, fsync'd with every checkpoint, and replayed into the store (what it lacks, none twice) when a
    tracker opens, so a store swap, a deleted database or an outage followed by a kill loses no point."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    def read(self) -> list[Point]:
        """Every point logged so far, without a last line a crash cut short; a damaged line is refused by name."""
        fix = (f"delete the damaged line of {self.path}: the MLflow run keeps the points it already received, and "
               "the line's point is lost")
        return [(k, float(v), t, s) for k, v, t, s in read_json_lines(self.path, fix, _point_problem)]

    def append(self, points: Iterable[Point]) -> None:
        lines = "".join(json.dumps([k, v, t, s]) + "\n" for k, v, t, s in points)
        if not lines:
            return
        if self._fd is None:
            # O_NOFOLLOW: a link planted after the run directory was checked is refused, never appended through
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            end_cut_line(self._fd)  # never glue a point to a line a crash cut short
        os.write(self._fd, lines.encode())

    def sync(self) -> None:
        """Make every point so far durable (called with each checkpoint)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _point_problem(entry) -> str:
    """What keeps a line from being a point [key, value, timestamp, step] ('' when nothing); a value may be NaN."""
    ok = (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
          and isinstance(entry[1], int | float) and COUNT.holds(entry[2]) and COUNT.holds(entry[3])
          and not any(isinstance(x, bool) for x in entry))
    return "" if ok else f"holds {json.dumps(entry)[:60]}, not a point [key, value, time in ms, step]"


def reconcile(log: MetricLog, logged_upto: dict[str, int], stored_steps) -> list[Point]:
    """Raise `logged_upto` to every step the log holds and return its points whose (key, step) the store lacks
    (`stored_steps(key)`), first occurrence of each."""
    points = log.read()
    stored = {k: stored_steps(k) for k in {p[0] for p in points}}
    missing, seen = [], set()
    for point in points:
        key, step = point[0], point[3]
        logged_upto[key] = max(logged_upto.get(key, step), step)
        if step not in stored[key] and (key, step) not in seen:
            missing.append(point)
        seen.add((key, step))
    if missing:
        logger.warning("sending %d metric points the store lacks from %s", len(missing), log.path)
    return missing


class Tracker:
    """One MLflow run fed through a buffer that a background thread ships with `log_batch`: `Tracker.open` (training,
    rank 0) or `Tracker.attach` (adding results to a finished run). `MlflowClient`, never the fluent global run, so
    several trackers coexist in one process."""

    def __init__(self, client, run_id: str, cfg: TrackingConfig, logged_upto: dict[str, int], terminate: bool,
                 log: MetricLog | None = None, replay: list | None = None, outbox: Path | None = None):
        self.run_id = run_id
        self._log = log
        self._client, self._cfg, self._terminate = client, cfg, terminate
        self._logged_upto = logged_upto
        self._known_keys: set[str] = set()
        self._lock = threading.Lock()
        self._buffer: deque[Point] = deque(replay or [])
        self._inflight: list[Point] = []
        self._dropped = 0
        # With a run directory, artifacts wait in its outbox until MLflow holds them: one the store refused (a full
        # file system) is sent again on the next start, as unsent metric points are.
        self._outbox = outbox
        self._outbox_dir = outbox or Path(tempfile.mkdtemp(prefix="study-artifacts-"))
        self._outbox_dir.mkdir(parents=True, exist_ok=True)
        self._artifacts: deque[tuple[Path, str]] = deque(waiting(self._outbox_dir))
        self._wake, self._closing = threading.Event(), threading.Event()
        self._final: tuple[str | None, str | None] = ("FINISHED", None)
        self._deadline = math.inf
        self._closed = False
        self._monitor = None
        self._thread = threading.Thread(target=self._run, name=f"mlflow-flush-{run_id[:8]}", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)

    @classmethod
    def open(cls, run_key: str, experiment: str, run_name: str, tags: Mapping[str, str] | None = None,
             params: Mapping[str, Any] | None = None, cfg: TrackingConfig | None = None, log_path: Path | None = None,
             system_metrics: bool = False, check: Callable[[Any, Any], None] | None = None) -> Tracker:
        """Creates the run for `run_key`, or resumes it after a restart (never a second run for one key).

        `params` go through `flatten`; one already logged with another value raises ValueError. An unreachable or
        locked store is retried for `cfg.open_timeout_s`, then StudyError. With `log_path` (the run directory's
        metrics.jsonl) every point is appended there first, and what the store lacks of it is sent now.
        `check(client, run)` may refuse to resume the key's existing run (StudyError) before anything changes.
        """
        cfg = cfg or TrackingConfig()

        def start(client, experiment_id, deadline):
            from mlflow.entities import Param

            if check is not None:
                existing = call_with_retries(lambda: find_runs(client, experiment_id, run_key), cfg, deadline,
                                             "find run")
                if existing:
                    check(client, existing[0])
            run, missing = call_with_retries(lambda: open_run(client, experiment_id, run_key, run_name, tags or {},
                                                              flatten(params or {})), cfg, deadline, "open run")
            items = list(missing.items())
            for i in range(0, len(items), PARAMS_PER_CALL):
                batch = [Param(k, v) for k, v in items[i : i + PARAMS_PER_CALL]]
                call_with_retries(lambda: client.log_batch(run.info.run_id, params=batch, synchronous=True), cfg,
                                  deadline, "params")
            return run

        tracker = cls._connect(experiment, cfg, start, terminate=True, log=MetricLog(log_path) if log_path else None)
        if system_metrics:  # MLflow's monitor: CPU, memory, disk, network (GPU with pynvml) as `system/...` metrics
            try:
                import psutil  # noqa: F401  (the monitor needs it)
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            except ImportError:
                logger.info("system metrics are off: install psutil (and pynvml for GPUs) to record them")
            else:
                tracker._monitor = SystemMetricsMonitor(tracker.run_id, sampling_interval=cfg.system_metrics_s,
                                                        resume_logging=True, tracking_uri=tracker._client.tracking_uri)
                tracker._monitor.start()
        return tracker

    @classmethod
    def attach(cls, run_key: str, experiment: str, cfg: TrackingConfig | None = None) -> Tracker:
        """The existing run for `run_key`, to add results (`study eval`): its status, tags and params stay as they
        are, and `close` only flushes. Raises StudyError when no such run exists."""
        cfg = cfg or TrackingConfig()

        def find(client, experiment_id, deadline):
            runs = call_with_retries(lambda: find_runs(client, experiment_id, run_key), cfg, deadline, "find run")
            if not runs:
                raise StudyError("run_key", f"no MLflow run with key {run_key} in experiment {experiment}",
                                 "train the run first, or check the key with `study status`")
            return runs[0]

        tracker = cls._connect(experiment, cfg, find, terminate=False)
        tracker._logged_upto = {}  # results added to a finished run are new records, never taken for repeats
        return tracker

    @classmethod
    def _connect(cls, experiment: str, cfg: TrackingConfig, get_run: Callable, terminate: bool,
                 log: MetricLog | None = None) -> Tracker:
        with connected(cfg) as (client, uri, deadline):
            experiment_id = call_with_retries(lambda: get_or_create_experiment(client, uri, experiment), cfg, deadline,
                                              "experiment")
            run = get_run(client, experiment_id, deadline)
        # A run's latest value per key is the one at its largest step: everything up to it has landed already.
        logged_upto = {m.key: m.step for m in run.data.to_proto().metrics}
        replay = [] if log is None else reconcile(log, logged_upto, lambda k: {m.step for m in call_with_retries(
            lambda: client.get_metric_history(run.info.run_id, k), cfg, deadline, "metric history")})
        outbox = None if log is None else log.path.parent / ARTIFACT_OUTBOX
        return cls(client, run.info.run_id, cfg, logged_upto, terminate, log, replay, outbox)

    def record(self, what: str, fn: Callable[[Any, str], Any]) -> Any:
        """`fn(client, run_id)` now, for what is written once per run (lineage, the parent run), retried on
        transient errors for up to a minute. A failure is logged and gives None: lineage never stops training."""
        deadline = time.monotonic() + min(self._cfg.open_timeout_s, 60.0)
        try:
            return call_with_retries(lambda: fn(self._client, self.run_id), self._cfg, deadline, what)
        except Exception as exc:  # noqa: BLE001
            logger.warning("MLflow %s for run %s failed: %s", what, self.run_id, short(exc))
            return None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffers one point per key at `step` and returns at once (no I/O; pass Python numbers, since `float()` of a
        CUDA tensor synchronises). Points at or below the step the run had logged for their key when opened are
        skipped: a resumed run recomputes them identically."""
        if self._closed:
            raise RuntimeError(f"log_metrics on closed tracker for run {self.run_id}")
        timestamp, step = int(time.time() * 1000), int(step)
        points = []
        for key, value in metrics.items():
            if key not in self._known_keys:
                if not _METRIC_KEY.match(key):
                    raise ValueError(f"metric key {key!r}: MLflow allows letters, digits, _ - . / : and space")
                self._known_keys.add(key)
            if step > self._logged_upto.get(key, -math.inf):
                points.append((key, float(value), timestamp, step))
        if self._log is not None:
            self._log.append(points)  # the run directory's record first: a kill after this loses nothing
        with self._lock:
            self._buffer.extend(points)
            overflow = len(self._buffer) - self._cfg.max_buffer
            for _ in range(overflow):
                self._buffer.popleft()
            if overflow > 0 and self._dropped == 0:
                logger.warning("tracking buffer full (%d points): dropping the oldest", self._cfg.max_buffer)
            self._dropped += max(overflow, 0)

    def log_artifact(self, source: Path | str, name: str) -> None:
        """Queues an artifact stored as `name` (may contain folders), copied now (`post`)."""
        entry = post(self._outbox_dir, source, name)
        with self._lock:
            self._artifacts.append(entry)

    def log_dict(self, data: Mapping[str, Any], name: str) -> None:
        """Queues `data` as a JSON (`.json`) or YAML (`.yaml`, `.yml`) artifact."""
        if name.endswith(".json"):
            self.log_artifact(json.dumps(plain(data), indent=2, default=str) + "\n", name)
        elif name.endswith((".yaml", ".yml")):
            import yaml

            self.log_artifact(yaml.safe_dump(plain(data), sort_keys=False), name)
        else:
            raise ValueError(f"artifact name {name!r} must end in .json, .yaml or .yml")

    def sync(self) -> None:
        """Make the run directory's metric log durable up to now (with every checkpoint)."""
        if self._log is not None:
            self._log.sync()

    def pending(self) -> int:
        """Metric points and artifacts not yet delivered."""
        with self._lock:
            return len(self._buffer) + len(self._inflight) + len(self._artifacts)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Ships everything buffered now (call before a checkpoint); True when it all landed within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while self.pending() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        return self.pending() == 0

    def close(self, status: str | None = "FINISHED", reason: str | None = None, timeout_s: float = 60.0) -> int:
        """Flushes everything (retrying for up to `timeout_s`), sets `study.failure_reason` to `reason` if given, and
        ends the run with `status` (FINISHED, FAILED or KILLED; None, or an attached run: only flushes). Returns within
        `timeout_s + cfg.terminate_timeout_s` the number of points and artifacts not delivered."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status {status!r}: use one of {', '.join(STATUSES)}, or None to only flush")
        if not self._closed:
            self._closed = True
            atexit.unregister(self._close_at_exit)
            if (monitor := self._monitor) is not None:
                monitor.finish()  # its last samples land while the run is still RUNNING
                try:  # and those it took since it last published, which it drops otherwise
                    if any(m._metrics for m in monitor.monitors):
                        monitor.publish_metrics(monitor.aggregate_metrics())
                        monitor.mlflow_logger.flush()
                except Exception as err:  # system metrics are a convenience: a failure here never fails the run
                    logger.warning("the last system metrics were not sent: %s", err)
            self._final = (status, reason)
            self._deadline = time.monotonic() + timeout_s
            self._closing.set()
            self._wake.set()
        self._thread.join(max(self._deadline - time.monotonic(), 0.0) + self._cfg.terminate_timeout_s)
        if self._log is not None:
            self._log.sync()
            self._log.close()
        left = self.pending()
        if left:
            logger.error("MLflow run %s closed with %d points/artifacts undelivered", self.run_id, left)
        return left

    def _close_at_exit(self) -> None:
        self.close("FAILED", reason="process exited without closing its tracker", timeout_s=5.0)

    def _run(self) -> None:
        """The flusher: ships every flush_interval_s; on a transient failure keeps everything and backs off."""
        delay, outage_since = self._cfg.retry_initial_s, None
        while True:
            closing = self._closing.is_set()
            try:
                self._ship()
            except Exception as exc:
                if not is_transient(exc):
                    self._drop_rejected(exc)
                    continue
                if outage_since is None:
                    outage_since = time.monotonic()
                    logger.warning("MLflow unavailable (%s); keeping %d points and retrying", short(exc),
                                   self.pending())
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    break
                # a close() call cuts the wait short (once it has, the event no longer waits)
                (time.sleep if closing else self._closing.wait)(min(jittered(delay), remaining))
                delay = min(2 * delay, self._cfg.retry_max_s)
                continue
            if outage_since is not None:
                logger.warning("MLflow reachable again after %.0f s", time.monotonic() - outage_since)
                outage_since, delay = None, self._cfg.retry_initial_s
            if closing:
                break
            self._wake.wait(self._cfg.flush_interval_s)
            self._wake.clear()
        self._finish()

    def _ship(self) -> None:
        """Sends buffered points, then queued artifacts, until none are left; raises on the first failure."""
        from mlflow.entities import Metric

        while True:
            with self._lock:
                if not self._inflight:
                    take = min(len(self._buffer), self._cfg.batch_points)
                    self._inflight = [self._buffer.popleft() for _ in range(take)]
                batch, artifact = self._inflight, self._artifacts[0] if self._artifacts else None
            if batch:
                # A batch retried after a lost reply carries the same timestamps; the SQL store drops exact repeats.
                self._client.log_batch(self.run_id, metrics=[Metric(*p) for p in batch], synchronous=True)
                with self._lock:
                    self._inflight = []
            elif artifact is not None:
                copied, name = artifact
                if copied.is_dir():
                    self._client.log_artifacts(self.run_id, str(copied), name)
                else:
                    self._client.log_artifact(self.run_id, str(copied), name.rpartition("/")[0] or None)
                with self._lock:
                    self._artifacts.popleft()
                shutil.rmtree(copied.parent, ignore_errors=True)
            else:
                return

    def _drop_rejected(self, exc: Exception) -> None:
        """Gives up what `_ship` was sending when MLflow refused it for good (retrying would block all after it)."""
        with self._lock:
            if self._inflight:
                what = f"{len(self._inflight)} points"
                self._dropped += len(self._inflight)
                self._inflight = []
            elif self._artifacts:
                what = f"artifact {self._artifacts.popleft()[1]}" + (
                    " (kept in the run directory: the run's next start sends it again)" if self._outbox else "")
            else:
                what = "nothing it could identify"
        logger.error("MLflow rejected %s for run %s: %s", what, self.run_id, short(exc))

    def _finish(self) -> None:
        status, reason = self._final
        deadline = max(self._deadline, time.monotonic()) + self._cfg.terminate_timeout_s
        try:
            if self._terminate and status is not None:
                if reason:
                    tag = reason[:MAX_TAG_CHARS]
                    call_with_retries(lambda: self._client.set_tag(self.run_id, schema.TAG_FAILURE_REASON, tag),
                                      self._cfg, deadline, "tag")  # fmt: skip
                call_with_retries(lambda: self._client.set_terminated(self.run_id, status), self._cfg, deadline, "end")
        except Exception as exc:
            logger.error("could not mark MLflow run %s %s: %s", self.run_id, status, short(exc))
        if self._outbox is None or not waiting(self._outbox_dir):
            shutil.rmtree(self._outbox_dir, ignore_errors=True)
        else:
            logger.error("%d artifacts of run %s did not reach MLflow; they wait in %s and the run's next start sends "
                         "them again", len(waiting(self._outbox_dir)), self.run_id, self._outbox_dir)


class NullTracker:
    """What ranks other than 0 hold: the same calls, doing nothing."""

    def __init__(self) -> None:
        self.run_id = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, source: Path | str, name: str) -> None:
        pass

    def record(self, what: str, fn: Callable[[Any, str], Any]) -> Any:
        return None

    def sync(self) -> None:
        pass

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self, status: str | None = "FINISHED", reason: str | None = None, timeout_s: float = 60.0) -> int:
        return 0


RunTracker = Tracker | NullTracker
"""What training code may call on a run's tracker: what both define."""
