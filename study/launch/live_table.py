"""One live table across the runs of a local launch (`study launch cluster=local`, `study demo`): each run's state,
step of total, loss, tokens/s and ETA, read from the progress.json its trainer replaces at every logged step. It
redraws only on a terminal: a pipe or a file gets the launcher's plain `done` / `FAILED` lines."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from study.config.spec import RunSpec
from study.errors import StudyError
from study.files import COUNT, NUMBER, Kind, optional, read_json, shape_problem

WAITING, RUNNING, DONE, FAILED = "waiting", "running", "done", "FAILED"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class LiveTable:
    """The table for `runs`; `mark(key, state)` records what the launcher knows (running, done, FAILED)."""

    def __init__(self, runs: Iterable[RunSpec]):
        self.runs = list(runs)
        self.states = {r.key: WAITING for r in self.runs}
        self._live = None

    def mark(self, key: str, state: str) -> None:
        self.states[key] = state

    def rows(self) -> list[tuple[str, ...]]:
        """(run, state, step, loss, tokens/s, ETA) per run, as shown."""
        out = []
        for run in self.runs:
            figures, state = _read(run), self.states[run.key]
            out.append((run.name, state, "-", "-", "-", "-") if figures is None else
                       (run.name, state, f"{figures['step']}/{figures['max_steps']}", f"{figures['loss']:.4f}",
                        f"{figures['tokens_per_s']:,.0f}",
                        "-" if state in (DONE, FAILED) else _duration(figures.get("eta_s"))))
        return out

    def table(self):
        from rich.table import Table

        done = sum(s == DONE for s in self.states.values())
        table = Table(title=f"{done} of {len(self.runs)} runs done")
        for col in ("run", "state", "step", "loss", "tokens/s", "ETA"):
            table.add_column(col, justify="left" if col in ("run", "state") else "right")
        for row in self.rows():
            table.add_row(*row)
        return table

    def __enter__(self) -> LiveTable:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=sys.stderr)
        if console.is_terminal:
            self._live = Live(get_renderable=self.table, console=console, refresh_per_second=2, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()


_LOSS = Kind("a number, NaN once diverged", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
_FIGURES = {"step": COUNT, "max_steps": COUNT, "loss": _LOSS, "tokens_per_s": NUMBER, "eta_s": optional(NUMBER)}


def _read(run: RunSpec) -> dict | None:
    """The run's latest figures; None (shown as unknown) while it has none, or holds what is not its figures: the
    trainer replaces the file at its next logged step, so a damaged one is never a reason to stop the launch."""
    try:
        figures = read_json(run.run_dir.progress, "")  # a link in its place is refused, as everywhere in a run folder
    except StudyError:
        return None
    return None if shape_problem(figures, _FIGURES) else figures
