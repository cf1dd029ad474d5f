"""The map cannot go stale: docs/ARCHITECTURE.md names every module of `study/` and `analysis/` in its module index,
and every module, package or file it names exists."""

from __future__ import annotations

import re

from conftest import ROOT

DOC = ROOT / "docs" / "ARCHITECTURE.md"


def modules_on_disk() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in ("study", "analysis") for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py"}


def index_rows() -> dict[str, str]:
    """The module index: each row's module path and the job it states."""
    text = DOC.read_text()
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+\.py)` \| (.*?) \|$", section, re.M)
    return dict(rows)


def test_every_module_is_in_the_index_with_its_job_and_every_indexed_one_exists():
    rows = index_rows()
    on_disk = modules_on_disk()
    assert sorted(on_disk - rows.keys()) == [], "modules missing from docs/ARCHITECTURE.md's module index"
    assert sorted(rows.keys() - on_disk) == [], "the index names modules that no longer exist"
    assert [m for m, job in rows.items() if len(job.split()) < 4] == [], "an index row without its job"


def test_every_path_the_docs_name_exists():
    """Backticked paths in the architecture and analysis docs (`study/launch/`, `analysis/surface.py`,
    `sweeps/experiment/`) are files or folders of the checkout."""
    named = set()
    for doc in (DOC, ROOT / "analysis" / "README.md"):
        named |= set(re.findall(r"`((?:study|analysis|sweeps|tests|benchmarks|scripts|slurm)/[\w./-]*)`",
                                doc.read_text()))
    assert sorted(p for p in named if "*" not in p and "<" not in p and not (ROOT / p).exists()) == []


def test_the_layers_table_is_the_one_the_layout_test_enforces():
    """docs/ARCHITECTURE.md draws the layers top down; tests/test_layout.py holds them bottom up: the same packages,
    in the same order."""
    from test_layout import LAYERS

    text = DOC.read_text()
    table = text[text.index("| layer | packages"):].split("\n\n", 1)[0]
    drawn = []
    for row in re.findall(r"^\| \d+ \| (.*?) \| .* \|$", table, re.M):
        names = set()
        for token in re.findall(r"`([^`]+)`", row):
            if token.startswith("python -m "):
                names.add(token.removeprefix("python -m ") + ".__main__")
            else:
                names.add(token.rstrip("/").removesuffix(".py").replace("/", "."))
        drawn.append(names)
    assert drawn[::-1] == [set(layer) - {"study"} for layer in LAYERS]
