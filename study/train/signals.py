"""How a run is asked to stop: SLURM's warning signal before a time limit or preemption, or TERM."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


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
