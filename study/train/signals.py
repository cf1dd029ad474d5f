"""How a run is asked to stop: SLURM's warning signal before a time limit or preemption, or TERM."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_EARLY: list[str] = []
"""A TERM that arrived after `catch_early` and before a StopRequest took the signals over."""


def catch_early() -> None:
    """Keep a TERM that arrives before the loop installs its StopRequest (imports, data preparation, building the
    model): the loop then stops at its first step, with a checkpoint. Without it, submitit's own handler drops the
    TERM and the run trains on until the launcher's grace period ends and it is killed. Called where a job starts."""
    def keep(signum, frame) -> None:
        _EARLY.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, keep)


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
        """Take USR2 and TERM over; a TERM kept since `catch_early` counts as already asked."""
        req = cls(signal_name=_EARLY[-1] if _EARLY else None)
        _EARLY.clear()
        for sig in STOP_SIGNALS:
            req._previous[sig] = signal.signal(sig, req._handle)
        return req

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
