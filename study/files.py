"""Files written whole and locked, and records read back checked: what run directories, caches and launch records
share. A record a user can open, edit or damage by hand (a result.json, a launch or tuning record, a profile) is read
through `read_json`, `read_json_lines` or `read_mapping`: whatever keeps it from being read or makes it of another
shape is refused by the file's name with its reader's fix (usually: delete it, and what recomputes it), never met
later as a traceback."""

from __future__ import annotations

import fcntl
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

from study.errors import StudyError

LARGEST = 1e100
"""The largest magnitude of a number a record holds: losses, times, steps, counts and work are nowhere near it, and
squares and sums of thousands of numbers below it stay finite in float64. A larger one (1e308) was typed or damaged."""


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


def damaged(path: Path, problem: str, fix: str) -> StudyError:
    """The refusal of a record that cannot be used: its file, what is wrong with it, and the fix."""
    return StudyError(str(path), problem, fix)


def _text(path: Path, fix: str) -> str:
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise damaged(path, "is a directory, not a file", fix) from None
    except OSError as err:
        raise damaged(path, f"cannot be read ({os.strerror(err.errno) if err.errno else err})", fix) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise damaged(path, f"is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})", fix) from None


def _parse(text: str) -> Any:
    """JSON, or ValueError (also for nesting past Python's stack, and an integer of more digits than it converts)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep") from None


def read_json(path: Path, fix: str) -> Any:
    """The JSON document in the file `path`, refused (naming the file and `fix`) when the path is a directory, the
    file cannot be read, or its text is not UTF-8 or not JSON."""
    text = _text(path, fix)
    try:
        return _parse(text)
    except ValueError as err:
        raise damaged(path, f"does not read as JSON ({err})", fix) from None


def read_json_lines(path: Path, fix: str, check: Callable[[Any], str] | None = None) -> list:
    """The entries of an append-only record of JSON lines, none before the first is written. A last line a killed
    writer cut short (no newline ends it) is left out: the next append removes it (`end_cut_line`). Refused like
    `read_json`, naming the line, when any other line is not JSON or `check` says what is wrong with its entry."""
    if not path.exists() and not path.is_symlink():
        return []
    lines = _text(path, fix).split("\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = _parse(line)
        except ValueError as err:
            if number == len(lines):  # not ended by a newline: cut short by a killed writer
                break
            raise damaged(path, f"line {number} does not read as JSON ({err})", fix) from None
        if check is not None and (problem := check(entry)):
            raise damaged(path, f"line {number} {problem}", fix)
        out.append(entry)
    return out


def end_cut_line(fd: int) -> None:
    """Before appending to the record open at `fd`: remove a last line a killed writer cut short, so that the new
    lines start a line of their own and no line of JSON is glued to half of one."""
    end = os.fstat(fd).st_size
    if end == 0 or os.pread(fd, 1, end - 1) == b"\n":
        return
    while end > 0:
        start = max(0, end - 65536)
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            os.ftruncate(fd, start + at + 1)
            return
        end = start
    os.ftruncate(fd, 0)


class Kind(NamedTuple):
    """What a record's field must hold: `holds(value)`, and `what` says it for the refusal."""

    what: str
    holds: Callable[[Any], bool]


def _number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= LARGEST)


TEXT = Kind("text", lambda v: isinstance(v, str))
NUMBER = Kind(f"a finite number of magnitude at most {LARGEST:g}", _number)
COUNT = Kind(f"a whole number from 0 to {LARGEST:g}", lambda v: isinstance(v, int) and _number(v) and v >= 0)
FLAG = Kind("true or false", lambda v: isinstance(v, bool))
LIST = Kind("a list", lambda v: isinstance(v, list))
NUMBERS = Kind("a list of finite numbers", lambda v: isinstance(v, list) and all(_number(x) for x in v))
TEXTS = Kind("a list of text", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
MAPPING = Kind("a mapping", lambda v: isinstance(v, dict))


def optional(kind: Kind) -> Kind:
    """The kind, or null."""
    return Kind(f"{kind.what}, or null", lambda v: v is None or kind.holds(v))


def shape_problem(record: Any, fields: dict[str, Kind], present: dict[str, Kind] | None = None) -> str:
    """What keeps `record` from being a mapping holding each of `fields` of its kind, and each of `present` it holds
    (a field older versions did not write) of its kind; '' when nothing does."""
    if not isinstance(record, dict):
        json_type = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(record), "number")
        return f"holds a JSON {json_type}, not a mapping"
    if (missing := next((name for name in fields if name not in record), None)) is not None:
        return f"has no `{missing}`"
    for name, kind in {**fields, **(present or {})}.items():
        if name in record and not kind.holds(record[name]):
            shown = json.dumps(record[name])
            return f"has `{name}` {shown if len(shown) <= 60 else shown[:57] + '...'}, not {kind.what}"
    return ""


def read_mapping(path: Path, fields: dict[str, Kind], fix: str, present: dict[str, Kind] | None = None) -> dict:
    """The JSON mapping in the file `path`, checked by `shape_problem` (other fields unchecked); refused as
    `read_json` refuses, and naming the first field missing or of another kind."""
    record = read_json(path, fix)
    if problem := shape_problem(record, fields, present):
        raise damaged(path, problem, fix)
    return record

