"""Build-once cache entries: keyed directories that appear atomically, built under a file lock.

An entry is a directory that only ever comes into existence by `os.rename` of a finished temporary
directory, so a crash mid-build leaves a temporary name that no reader looks at. The lock (fcntl)
makes the parallel jobs of a sweep wait for one builder instead of each building its own copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_MARK = ".tmp-"


def cache_key(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def fingerprint_path(path: Path) -> str:
    """Hash of every file's relative name, size and modification time under `path` (or of the file itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [(str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns)
             for p in files]
    return cache_key(stats)


def sha256_file(path: Path) -> str:
    """SHA-256 of a whole file, read 4 MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(paths: list[Path]) -> str:
    """Content hash of small files (tokenizer definitions), independent of where they live."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


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


def build_once(entry: Path, build: Callable[[Path], None]) -> Path:
    """Return `entry`, first calling `build(tmp_dir)` and renaming tmp_dir to it if it does not exist yet."""
    if entry.is_dir():
        return entry
    with file_lock(entry.with_name(entry.name + ".lock")):
        if entry.is_dir():
            return entry
        # Holding the lock means no one else is building this entry: any temporary sibling is a dead build's.
        for stale in entry.parent.glob(f"{entry.name}{TMP_MARK}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = entry.with_name(f"{entry.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            build(tmp)
            os.rename(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return entry


PARTIAL = ".partial"


def build_resumable(entry: Path, build: Callable[[Path], None]) -> Path:
    """Like :func:`build_once`, but the build directory `<entry>.partial` survives a crash: the next builder (under
    the same lock) calls `build` on it again, and `build` continues from whatever progress record it left there."""
    if entry.is_dir():
        return entry
    with file_lock(entry.with_name(entry.name + ".lock")):
        if entry.is_dir():
            return entry
        for stale in entry.parent.glob(f"{entry.name}{TMP_MARK}*"):  # a dead build_once's (before resumable builds)
            shutil.rmtree(stale, ignore_errors=True)
        work = entry.with_name(entry.name + PARTIAL)
        work.mkdir(parents=True, exist_ok=True)
        build(work)
        os.rename(work, entry)
    return entry
