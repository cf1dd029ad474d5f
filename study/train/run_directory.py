"""What the trainer does to its run directory around training: checks that it can write there before anything is
tracked, claims it for its run key, keeps the tokenizer it trained with, and names a full disk as the user's
problem to fix."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from study.config.spec import RunSpec, held_spec, write_spec
from study.files import replace_file
from study.errors import StudyError
from study.train import checkpoint


def writable(rdir: Path) -> None:
    """Fail before anything is tracked when the run directory cannot hold checkpoints."""
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        probe = rdir / f".write-probe-{os.getpid()}"  # one per process: trainers may race here
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as err:
        fix = ("free space on that file system or point paths.runs elsewhere" if err.errno == errno.ENOSPC
               else "point paths.runs at a writable directory (shared between nodes on a cluster)")
        raise StudyError("paths.runs", f"cannot write the run directory {rdir} ({os.strerror(err.errno or 0)})",
                         fix) from None


def claim(spec: RunSpec) -> None:
    """The run directory holds this run's spec, never another's."""
    held_spec(spec)
    write_spec(spec)  # the run directory always holds the spec that trained it


def keep_tokenizer(source: Path, copy: Path, eos_id: int) -> None:
    """The run directory keeps the tokenizer it was trained with, and the token that ended its documents in
    tokenizer_config.json beside it (as transformers declares one), so evaluation and export never need the data
    or its source directory again: a transformers directory's declared EOS is not among the tokenizer's own."""
    import json

    from study.data.tokenizer import TOKENIZER_CONFIG, load_tokenizer

    config = json.dumps({"eos_token": load_tokenizer(source).id_to_token(eos_id)}).encode()
    for path, content in ((copy, source.read_bytes()), (copy.with_name(TOKENIZER_CONFIG), config)):
        if not (path.is_file() and path.read_bytes() == content):
            replace_file(path, content)


def out_of_space(err: OSError) -> bool:
    """Whether a write failed because the file system (or the user's quota on it) is full."""
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space(spec: RunSpec, err: OSError) -> StudyError:
    """A full run directory as the user's error: where, how much is free, what to free, where a restart resumes."""
    import shutil

    rdir = spec.run_dir.path
    last = checkpoint.latest(rdir)
    return StudyError("paths.runs", f"no space left on {rdir} (writing {err.filename or 'to it'}; "
                      f"{shutil.disk_usage(rdir).free >> 20} MiB free on its file system)",
                      "free space on that file system (other runs' old checkpoints, or a lower train.keep_last), or "
                      "move the runs folder to one with room and point paths.runs there; started again, the run "
                      f"resumes from {last.name if last else 'step 0'}")
