"""Exactly one trainer per run key: an exclusive OS lock (`flock`) on `<run dir>/.lease`, held for the whole run.

The kernel releases it when the process dies, however it dies, so a stale lease never blocks a restart. A second
trainer of the key waits until the first has stopped, then resumes from its checkpoint, never touching the other's
checkpoints while it runs. Under FSDP rank 0 holds the lease and every rank waits with it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from study.schema import RunDir
from study.train.distributed import Dist, all_reduce_max

POLL_S = 2.0


class Lease:
    def __init__(self, run_dir: Path):
        run = RunDir(run_dir)
        run.refuse_links()  # before the run writes anything: nothing it writes lies behind a link
        self.path = run.lease
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        # O_NOFOLLOW: a link planted while this trainer waits is refused, never truncated through
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            # what a trainer wrote, `host pid`; anything else (not UTF-8 either) is shown, never a reason to fail
            return self.path.read_bytes().decode(errors="replace").strip() or "another process"
        except OSError:
            return "another process"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def held_by(run_dir: Path) -> str | None:
    """Who trains the run now: the lease's `host pid` while a live process holds it, else None. Read-only: it creates
    no file, and its shared lock lasts an instant (a trainer starting just then waits one poll and takes the lease)."""
    try:
        fd = os.open(RunDir(run_dir).lease, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.read(fd, 256).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # releases the shared lock


def acquire(run_dir: Path, key: str, d: Dist) -> Lease | None:
    """Hold the run's lease on rank 0, waiting while another trainer has it (every rank waits together, polling,
    so no collective blocks for long). Returns the lease on rank 0, None elsewhere."""
    lease = Lease(run_dir) if d.is_main else None
    said = False
    while True:
        got = lease.try_acquire() if lease is not None else False
        if all_reduce_max(float(got), d) > 0:
            return lease
        if lease is not None and not said:
            print(f"run {key} is being trained by {lease.holder()}: waiting for it to stop, then resuming",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(POLL_S)
