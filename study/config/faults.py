"""Fault injection settings, used by tests only (none of them changes a run's key)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FaultsConfig:
    nan_at_step: int = -1
    """Make the loss NaN at this step (-1 never)."""
    stop_at_step: int = -1
    """Behave as if SIGUSR2 arrived at this step (-1 never)."""
    sleep_per_step: float = 0.0
    """Sleep this long after every step, so signals land mid-run."""
    kill_prepare_after_chunks: int = -1
    """SIGKILL the data preparation after this many tokenised chunks (-1 never)."""
