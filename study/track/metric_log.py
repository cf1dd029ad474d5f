"""The run directory's own record of every metric point, `<run dir>/metrics.jsonl`: appended before a point is queued
for MLflow, fsync'd with every checkpoint, and replayed into the store (what it lacks, none twice) when a tracker
opens, so a store swap, a deleted database or an outage followed by a kill loses no point."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from study.files import COUNT, end_cut_line, read_json_lines

logger = logging.getLogger(__name__)
Point = tuple[str, float, int, int]
"""(key, value, timestamp in ms, step)."""


class MetricLog:
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
