"""What identifies a run in MLflow (its tags) and how a run is asked to stop (signals)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from study.config import RunConfig

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def run_tags(cfg: RunConfig, key: str) -> dict[str, str]:
    """The DESIGN schema's tags; the SLURM job id when the run is a SLURM job."""
    tags = {"study.run_key": key, "study.experiment": cfg.experiment, "study.variant": cfg.variant,
            "study.scale": cfg.scale, "study.seed": str(cfg.seed), "study.stage": cfg.stage,
            "study.baseline": cfg.baseline}
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    job = job or os.environ.get("SLURM_JOB_ID")
    if job:
        tags["study.slurm_job_id"] = job
        tags["study.slurm_restart_count"] = os.environ.get("SLURM_RESTART_COUNT", "0")
    return tags


@dataclass
class StopRequest:
    """Set by USR2 (SLURM's warning before a time limit or preemption) or TERM; the loop agrees on it across ranks,
    saves a checkpoint at the same step everywhere, and stops. Replaces the handlers for its lifetime only."""

    signal_name: str | None = None
    _previous: dict = field(default_factory=dict)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @classmethod
    def install(cls) -> StopRequest:
        req = cls()
        for sig in STOP_SIGNALS:
            req._previous[sig] = signal.signal(sig, req._handle)
        return req

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
