"""Build-once cache entries: keyed directories that appear only by `os.rename` of a finished build directory (a
crash leaves a name no reader looks at), built under a file lock so a sweep's jobs wait for one builder."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from study.config.identity import json_digest
from study.files import file_lock

TMP_MARK = ".tmp-"
PARTIAL = ".partial"


def cache_key(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts."""
    return json_digest(parts, 16)


def fingerprint_path(path: Path) -> str:
    """Hash of every file's relative name, size and modification time under `path` (or of the file itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [(str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns)
             for p in files]
    return cache_key(stats)


def sha256_file(path: Path) -> str:
    """SHA-256 of a whole file."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(paths: list[Path]) -> str:
    """Content hash of small files (tokenizer definitions), independent of where they live."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build_once(entry: Path, build: Callable[[Path], None], resumable: bool = False) -> Path:
    """Return `entry`, first calling `build(work_dir)` and renaming work_dir to it if it does not exist yet. A failed
    build's directory is removed; with `resumable` it is `<entry>.partial`, which the next builder hands to `build`
    again to continue from the progress it recorded."""
    if entry.is_dir():
        return entry
    with file_lock(entry.with_name(entry.name + ".lock")):
        if entry.is_dir():
            return entry
        # Holding the lock means no one else is building this entry: any temporary sibling is a dead build's.
        for stale in entry.parent.glob(f"{entry.name}{TMP_MARK}*"):
            shutil.rmtree(stale, ignore_errors=True)
        if resumable:
            work = entry.with_name(entry.name + PARTIAL)
            work.mkdir(exist_ok=True)
        else:
            work = entry.with_name(f"{entry.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
            work.mkdir()
        try:
            build(work)
            os.rename(work, entry)
        finally:
            if not resumable and work.exists():
                shutil.rmtree(work, ignore_errors=True)
    return entry
