"""`--restart`: train a run again from step 0, its earlier training set aside rather than continued or lost (every
checkpoint damaged, the data it started on changed, a result of record to replace).

Everything in the run directory but the spec and resolved config moves into `replaced/<UTC time>/`, and the key's
MLflow runs are soft-deleted (restorable) with tag `study.replaced`, so the next start opens a fresh curve. The move
goes through `replaced/<time>.partial/`, made first: the next start finishes an interrupted restart before it trains.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from study import schema
from study.config.spec import RunSpec
from study.errors import StudyError
from study.schema import not_a_link
from study.track.store import retire_runs
from study.train.lease import Lease

REPLACED = "replaced"
PARTIAL = ".partial"
KEPT = ("run.json", "config.yaml", REPLACED)
"""What a restart leaves in place (hidden files too: the lease and other processes' transient files)."""


def replaced(spec: RunSpec) -> Path:
    """Where a run's earlier trainings lie, one folder each (never through a link: it is written to)."""
    return not_a_link(spec.run_dir.path / REPLACED)


def interrupted(spec: RunSpec) -> Path | None:
    """The folder of a restart that was interrupted, if any."""
    root = replaced(spec)
    return min(root.glob(f"*{PARTIAL}"), default=None) if root.is_dir() else None


def restart(spec: RunSpec, partial: Path | None = None) -> None:
    """Set the run's earlier training aside (the caller holds its lease): into `partial`, an interrupted restart's
    folder, or a new one."""
    rdir = spec.run_dir.path
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if partial is None:
        partial = replaced(spec) / f"{when.replace(':', '')}-{os.getpid()}{PARTIAL}"
    partial.mkdir(parents=True, exist_ok=True)
    done = partial.with_name(partial.name[:-len(PARTIAL)])
    retired = retire_runs(spec.key, spec.config.experiment, spec.config.tracking,
                          f"trained again from step 0 (--restart) at {when}; its run directory's earlier files are in "
                          f"{done}")
    for entry in sorted(rdir.iterdir()):
        if entry.name not in KEPT and not entry.name.startswith("."):
            os.rename(entry, partial / entry.name)
    if any(partial.iterdir()):
        os.rename(partial, done)
        kept = f"its earlier files are in {done}"
    else:
        partial.rmdir()
        kept = "it had no files to set aside"
    runs = (f"MLflow run{'s' * (len(retired) != 1)} {', '.join(retired)} deleted (restorable) and tagged "
            + schema.TAG_REPLACED if retired else "no MLflow run to set aside")
    print(f"run {spec.key} starts again from step 0: {kept}; {runs}", file=sys.stderr, flush=True)


def restart_idle(spec: RunSpec) -> None:
    """A restart before a launch submits the run (`study launch --restart KEY`): refused while a process trains the
    run (its lease is taken without waiting)."""
    spec.run_dir.path.mkdir(parents=True, exist_ok=True)
    lease = Lease(spec.run_dir.path)
    if not lease.try_acquire():
        raise StudyError("--restart", f"run {spec.key} is being trained by {lease.holder()}",
                         "stop that job or process first (`study status` names it), or let it end, then launch with "
                         "--restart again")
    try:
        restart(spec, interrupted(spec))
    finally:
        lease.release()
