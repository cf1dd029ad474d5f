"""`NullTracker`, the tracker of ranks other than 0, and `RunTracker`: it or `study.track.tracker.Tracker`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from study.track.tracker import Tracker


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


RunTracker = Union["Tracker", NullTracker]
"""What training code may call on a run's tracker: what both define."""
