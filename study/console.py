"""Where the command line's tables are printed."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
import unicodedata

PIPED_WIDTH = 200
"""Table width when stdout is not a terminal and COLUMNS is unset: wide enough that a run's row stays one line."""


def _columns() -> int | None:
    """COLUMNS when it is set to a positive number."""
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else None


def console():
    """A rich console as wide as the terminal, or COLUMNS when it is set, or PIPED_WIDTH into a pipe or file."""
    from rich.console import Console

    if columns := _columns():
        return Console(width=columns)  # said outright: rich alone does not apply it in every environment
    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def text_width() -> int | None:
    """Characters a line may take: COLUMNS when set, else the terminal's width; None into a pipe or file."""
    return _columns() or (shutil.get_terminal_size().columns if sys.stdout.isatty() else None)


def plain_table(title: str, columns: list[str], rows: list[list[str]], left: set[str] = frozenset(),
                width: int | None = None, keep: int = 1) -> str:
    """A table as fixed-width text, one line per row, never wrapped (a plan of hundreds of runs reads with grep or
    `less -S`; rich would take seconds to measure and wrap it): columns in `left` aligned left, the rest right. Wider
    than `width`, columns are left out from the right (never the first `keep`) and a last line names them."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    shown = len(columns)
    while width and shown > keep and sum(widths[:shown]) + 2 * (shown - 1) > width:
        shown -= 1

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if col in left else c.rjust(w)
                         for c, w, col in zip(cells[:shown], widths, columns)).rstrip()

    out = [wrapped(title, width), line(columns), line(["-" * w for w in widths]), *map(line, rows)]
    if shown < len(columns):
        out.append(wrapped(f"left out to fit {width} columns: {', '.join(columns[shown:])} (a wider COLUMNS shows "
                           "them)", width))
    return "\n".join(out)


def wrapped(text: str, width: int | None) -> str:
    """`text` as lines of at most `width` characters (one line when None: into a pipe or file)."""
    return textwrap.fill(text, width) if width else text


_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories a terminal does not show as themselves: controls (an escape sequence), formats (a right-to-left
override that reorders what follows, a zero-width space), surrogates and line or paragraph separators."""


def _escaped(c: str) -> str:
    """A character as Python writes it escaped (`\\u202e`, `\\x1b`)."""
    return c.encode("unicode_escape", "backslashreplace").decode("ascii")


def hidden_character(text: str) -> str | None:
    """The first character of `text` that a terminal or a shell line would not show as itself (`_HIDDEN`, tabs and
    newlines included), as its escape; None when every character shows."""
    return next((_escaped(c) for c in text if unicodedata.category(c) in _HIDDEN), None)


def for_terminal(text: str) -> str:
    """Text from an experiment file or the command line with every `_HIDDEN` character but newlines and tabs written
    as its escape, so what is shown is what the file holds."""
    if text.isprintable():
        return text
    return "".join(_escaped(c) if c not in "\n\t" and unicodedata.category(c) in _HIDDEN else c for c in text)
