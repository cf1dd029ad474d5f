"""Write one report document as Markdown and as a self-contained HTML page.

The report is a list of blocks (heading, paragraph, table, plot); both formats are rendered from the same
blocks so they cannot drift apart. HTML figures are embedded as base64 PNG and styles are inline, so the page
needs no network and no neighbouring files.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union


@dataclass(frozen=True)
class Heading:
    """A section title."""

    text: str
    """Title text."""
    level: int = 2
    """1 for the page title, 2 for sections, 3 below."""


@dataclass(frozen=True)
class Paragraph:
    """Plain prose (no markup)."""

    text: str
    """The paragraph."""


@dataclass(frozen=True)
class Table:
    """A table of already formatted cells."""

    header: Sequence[str]
    """Column titles."""
    rows: Sequence[Sequence[str]]
    """Cells, row by row."""


@dataclass(frozen=True)
class Plot:
    """A PNG on disk, shown with a caption."""

    path: Path
    """The PNG file; Markdown links it relatively, HTML embeds its bytes."""
    caption: str
    """One line under the image."""


Block = Union[Heading, Paragraph, Table, Plot]


def to_markdown(blocks: Sequence[Block]) -> str:
    """GitHub-flavoured Markdown; figures are linked by file name (they sit beside report.md)."""
    out = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Table):
            lines = [_md_row(block.header), _md_row(["---"] * len(block.header))]
            lines += [_md_row(row) for row in block.rows]
            out.append("\n".join(lines))
        else:
            out.append(f"![{block.caption}]({block.path.name})\n\n*{block.caption}*")
    return "\n\n".join(out) + "\n"


def to_html(blocks: Sequence[Block], title: str) -> str:
    """One HTML page with inline CSS and images as ``data:image/png;base64`` URIs."""
    body = []
    for block in blocks:
        if isinstance(block, Heading):
            body.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{html.escape(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{html.escape(c)}</th>" for c in block.header)
            rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                           for row in block.rows)
            body.append(f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>')
        else:
            data = base64.b64encode(block.path.read_bytes()).decode("ascii")
            caption = html.escape(block.caption)
            body.append(f'<figure><img alt="{caption}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{caption}</figcaption></figure>")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body) + "\n</body></html>\n"
    )


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


_CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:76rem;margin:2rem auto;"
    "padding:0 1rem;color:#222;line-height:1.45}"
    ".wide{overflow-x:auto}table{border-collapse:collapse;margin:0.8rem 0;font-size:0.88rem}"
    "th,td{border:1px solid #ccc;padding:0.25rem 0.55rem;text-align:right;white-space:nowrap}"
    "th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}"
    "figure{margin:1rem 0}img{max-width:100%;height:auto}figcaption{font-size:0.85rem;color:#555}"
    "h1{font-size:1.6rem}h2{font-size:1.25rem;margin-top:2rem;border-bottom:1px solid #ddd}h3{font-size:1.05rem}"
)
