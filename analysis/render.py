"""One report document, a list of blocks (heading, paragraph, table, plot, details), rendered to Markdown and to a
self-contained HTML page (figures as base64 PNG, inline styles: no network, no neighbouring files).
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

from analysis.decide import VERDICT_COLORS


MISSING = "—"
"""What a table cell shows where a value is missing or not finite."""


def number(x: float | None, spec: str = ".4f") -> str:
    """`x` formatted by `spec` (``format``'s mini-language), or `MISSING` for None, NaN and infinities."""
    return MISSING if x is None or not math.isfinite(x) else format(x, spec)


@dataclass(frozen=True)
class Heading:
    """A section title."""

    text: str
    level: int = 2
    """1 for the page title, 2 for sections, 3 below."""


@dataclass(frozen=True)
class Paragraph:
    """Plain prose (no markup)."""

    text: str


@dataclass(frozen=True)
class Table:
    """A table of already formatted cells."""

    header: Sequence[str]
    rows: Sequence[Sequence[str]]


@dataclass(frozen=True)
class Plot:
    """A PNG on disk, shown with a caption."""

    path: Path
    """The PNG file; Markdown links it relatively, HTML embeds its bytes."""
    caption: str
    """One line under the image."""


@dataclass(frozen=True)
class Details:
    """Blocks a reader opens on demand: collapsed in HTML, under a summary line in Markdown."""

    summary: str
    """The line shown while collapsed."""
    blocks: Sequence["Block"]
    """What opening it shows."""


Block = Union[Heading, Paragraph, Table, Plot, Details]


def to_markdown(blocks: Sequence[Block]) -> str:
    """GitHub-flavoured Markdown; figures are linked by file name (they sit beside report.md)."""
    return "\n\n".join(_markdown(block) for block in blocks) + "\n"


def _markdown(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {block.text}"
    if isinstance(block, Paragraph):
        return block.text
    if isinstance(block, Table):
        lines = [_md_row(block.header), _md_row(["---"] * len(block.header))]
        return "\n".join(lines + [_md_row(row) for row in block.rows])
    if isinstance(block, Details):
        # GitHub collapses <details>; the blank lines let the Markdown inside it render as Markdown
        inner = "\n\n".join(_markdown(b) for b in block.blocks)
        return f"<details><summary>{html.escape(block.summary)}</summary>\n\n{inner}\n\n</details>"
    return f"![{block.caption}]({block.path.name})\n\n*{block.caption}*"


def to_html(blocks: Sequence[Block], title: str) -> str:
    """One HTML page with inline CSS and images as ``data:image/png;base64`` URIs."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(_html(block) for block in blocks) + "\n</body></html>\n"
    )


def _html(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{html.escape(block.text)}</p>"
    if isinstance(block, Table):
        head = "".join(f"<th>{html.escape(c)}</th>" for c in block.header)
        rows = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in block.rows)
        # the box scrolls sideways, never the page: a wide table must not push the decision out of the window
        return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'
    if isinstance(block, Details):
        inner = "\n".join(_html(b) for b in block.blocks)
        return f"<details><summary>{html.escape(block.summary)}</summary>\n{inner}\n</details>"
    data = base64.b64encode(block.path.read_bytes()).decode("ascii")
    caption = html.escape(block.caption)
    return (f'<figure><img alt="{caption}" src="data:image/png;base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>")


def _cell(text: str) -> str:
    """A cell; a verdict gets its class, so the table shows it in the forest plot's colour."""
    kind = f' class="{text}"' if text in VERDICT_COLORS else ""
    return f"<td{kind}>{html.escape(text)}</td>"


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


_CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:76rem;margin:1rem auto;"
    "padding:0 1rem;color:#222;line-height:1.45}"
    # a long unbroken token (a store path, a metric list) wraps instead of widening the page
    "p,h1,h2,h3,figcaption,summary{overflow-wrap:anywhere}"
    ".wide{overflow-x:auto;max-width:100%}table{border-collapse:collapse;margin:0.8rem 0;font-size:0.88rem}"
    "th,td{border:1px solid #ccc;padding:0.25rem 0.55rem;text-align:right;white-space:nowrap}"
    "th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}"
    "figure{margin:1rem 0}img{max-width:100%;height:auto}figcaption{font-size:0.85rem;color:#555}"
    + "".join(f"td.{v}{{color:{c};font-weight:600}}" for v, c in VERDICT_COLORS.items()) +
    "details{margin:0.8rem 0}summary{cursor:pointer;font-weight:600}"
    "h1{font-size:1.6rem;margin:0.4rem 0}h2{font-size:1.25rem;margin-top:2rem;border-bottom:1px solid #ddd}"
    "h3{font-size:1.05rem}"
)
