"""Fault injection for the fault suite (`faults.*` settings), kept out of the training step: a callback of the loop
(study.train.callbacks) and the training-loss filter of its metrics; they do nothing unless a test set them."""

from __future__ import annotations

import time

from study.config.faults import FaultsConfig
from study.train.callbacks import Callback


class FaultHooks(Callback):
    def __init__(self, cfg: FaultsConfig):
        self.cfg = cfg

    def loss(self, step: int, value: float) -> float:
        """The logged loss, made NaN at `nan_at_step`."""
        return float("nan") if step == self.cfg.nan_at_step else value

    def before_stop(self, step: int, stop) -> None:
        """Sleep (so signals land mid-run) and, at `stop_at_step`, behave as if SIGUSR2 arrived."""
        if self.cfg.sleep_per_step:
            time.sleep(self.cfg.sleep_per_step)
        if step == self.cfg.stop_at_step:
            stop.signal_name = "SIGUSR2 (injected)"
