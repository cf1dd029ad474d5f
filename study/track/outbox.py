"""Artifacts waiting to reach MLflow, each copied into a folder of its own beside a file naming where it is stored; in
a run directory's outbox, one the store refused is sent again on the run's next start."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

ARTIFACT_OUTBOX = "artifacts-outbox"
"""Folder of a run directory where artifacts wait until MLflow holds them."""
ARTIFACT_NAME = ".name"
"""File beside a posted artifact holding the name it is stored under."""


def waiting(outbox: Path) -> list[tuple[Path, str]]:
    """The complete artifacts posted to `outbox`, oldest first, as (copied path, name)."""
    found = []
    for folder in sorted(outbox.iterdir(), key=lambda p: p.stat().st_mtime) if outbox.is_dir() else []:
        name_file = folder / ARTIFACT_NAME
        if name_file.is_file():
            name = name_file.read_text()
            found.append((folder / name.rpartition("/")[2], name))
    return found


def post(folder: Path, source: Path | str, name: str) -> tuple[Path, str]:
    """Copy an artifact into `folder` (a Path's file or folder, else `source` as text): (copied path, name)."""
    parts = name.strip("/").split("/")
    if not parts[-1] or ".." in parts:
        raise ValueError(f"artifact name {name!r} must be a relative path to a file")
    copied = Path(tempfile.mkdtemp(dir=folder)) / parts[-1]
    if isinstance(source, Path):
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, copied)
    else:
        copied.write_text(source)
    (copied.parent / ARTIFACT_NAME).write_text("/".join(parts))  # written last: a posted artifact is complete
    return copied, "/".join(parts)
