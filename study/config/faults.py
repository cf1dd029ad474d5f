"""Fault injection settings, used by tests only.

Each field's docstring says what it does; `study/config/identity.py` says which of them change a run's key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FaultsConfig:
    nan_at_step: int = -1
    """Fault injection for tests: make the loss NaN at this step (-1 never)."""
    stop_at_step: int = -1
    """Fault injection for tests: behave as if SIGUSR2 arrived at this step (-1 never)."""
    sleep_per_step: float = 0.0
    """Fault injection for tests: sleep this long after every step, so signals land mid-run."""
    kill_prepare_after_chunks: int = -1
    """Fault injection for tests: SIGKILL the data preparation after this many tokenised chunks (-1 never)."""
