"""Files written whole and locked: what run directories, caches and launch records share."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


def replace_file(path: Path, content: str | bytes) -> None:
    """Write `path` whole: into a hidden file of this process and thread beside it, then renamed over it, so a reader
    (or another process or thread writing it) never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        tmp.write_bytes(content if isinstance(content, bytes) else content.encode())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):  # the write's own error is the one to report
            tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        raise


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock held for the duration of the block (released by the kernel if we die)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
