"""Where the command line's tables are printed."""

from __future__ import annotations

import os
import sys

PIPED_WIDTH = 200
"""Table width when stdout is not a terminal and COLUMNS is unset: wide enough that a run's row stays one line."""


def console():
    """A rich console as wide as the terminal, or COLUMNS when it is set, or PIPED_WIDTH into a pipe or file."""
    from rich.console import Console

    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return Console(width=int(columns))  # said outright: rich alone does not apply it in every environment
    if sys.stdout.isatty():
        return Console()
    return Console(width=PIPED_WIDTH)
