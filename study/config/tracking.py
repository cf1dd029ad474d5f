"""How training runs reach MLflow: buffering, retries, timeouts (none of it changes a run's key)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrackingConfig:
    """How training runs reach MLflow."""

    uri: str = ""
    """Tracking URI; empty means $MLFLOW_TRACKING_URI, else an SQLite store `sqlite:///<cwd>/mlflow.db`."""
    flush_interval_s: float = field(default=2.0, metadata={"positive": True})
    """Seconds between background flushes of buffered metric points."""
    max_buffer: int = field(default=200_000, metadata={"positive": True})
    """Most metric points held in memory during an outage (about 30 MB); beyond it the oldest are dropped, counted."""
    batch_points: int = field(default=1000, metadata={"positive": True, "at_most": 1000})
    """Metric points per `log_batch` call (MLflow accepts at most 1000)."""
    retry_initial_s: float = field(default=1.0, metadata={"positive": True})
    """Wait after the first failed call; it doubles on each further failure, with +-50 % jitter."""
    retry_max_s: float = field(default=30.0, metadata={"positive": True})
    """Longest wait between retries."""
    open_timeout_s: float = field(default=300.0, metadata={"positive": True})
    """How long `Tracker.open` keeps retrying an unreachable or locked store before giving up."""
    checkpoint_flush_s: float = field(default=10.0, metadata={"positive": True})
    """Longest wait, before each checkpoint, for buffered points to land (an outage then only delays them)."""
    terminate_timeout_s: float = field(default=10.0, metadata={"positive": True})
    """Time `close` allows for ending the run after its flush deadline has passed."""
    system_metrics_s: float = 30.0
    """Seconds between samples of MLflow's system metrics (CPU, memory, disk, network; GPU with pynvml) while a run
    trains; 0 turns them off. They need psutil."""
