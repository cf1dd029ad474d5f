"""Training progress for people: a tqdm line on rank 0, and progress.json for the launcher's live table."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from study.files import replace_file
from study.train.callbacks import Callback
from study.train.distributed import Dist


class Progress(Callback):
    """One progress line on rank 0 (step, loss, tokens/s, ETA), and the same figures in the run directory's
    progress.json for whoever watches several runs at once (`study launch` on this machine, `study demo`). A callback
    of the loop: it moves on whenever the training loss is logged."""

    def __init__(self, d: Dist, start: int, total: int, name: str, path: Path | None = None):
        self.bar, self.path = None, path if d.is_main else None
        self.start, self.total, self.t0 = start, total, time.monotonic()
        if d.is_main:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=name, unit="step", dynamic_ncols=True,
                            mininterval=0.5 if sys.stderr.isatty() else 10.0)
        self.last = start

    def on_log(self, step: int, loss: float, tps: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.last)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
        self.last = step
        if self.path is not None:
            rate = (step - self.start) / max(time.monotonic() - self.t0, 1e-9)
            # replaced whole (write, then rename): a reader never sees half of it
            replace_file(self.path, json.dumps({"step": step, "max_steps": self.total, "loss": loss,
                                                "tokens_per_s": tps, "time": time.time(),
                                                "eta_s": (self.total - step) / rate if rate > 0 else None}))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
