"""MLflow's system metrics (CPU, memory, disk, network; GPU when pynvml is installed) for an open run."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def system_metrics_monitor(run_id: str, interval_s: float, tracking_uri: str):
    """MLflow's monitor sampling into `system/...` metrics of `run_id` every `interval_s`, started; None (said once
    in the log) without psutil, which it needs."""
    try:
        import psutil  # noqa: F401
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError:
        logger.info("system metrics are off: install psutil (and pynvml for GPUs) to record them")
        return None
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True,
                                   tracking_uri=tracking_uri)
    monitor.start()
    return monitor
