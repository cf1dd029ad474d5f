"""The map cannot go stale: docs/ARCHITECTURE.md names every module of `study/` and `analysis/` in its module index,
and every module, package or file it names exists."""

from __future__ import annotations

import re

from conftest import ROOT

DOC = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
FRONT_PAGE_LINES = 150
"""The README is a front page: the two commands, what they give, the commands in brief and where to read next."""


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
    """Backticked paths in the README, the guides in docs/ and the analysis doc (`study/launch/`,
    `analysis/surface.py`, `sweeps/experiment/`) are files or folders of the checkout."""
    named = set()
    for doc in (README, *GUIDES, ROOT / "analysis" / "README.md"):
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


def _without_code(text: str) -> str:
    """Markdown with its fenced blocks and inline code removed: what is left is where links and headings live."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"(?ms)^```.*?^```[^\n]*$", "", text))


def heading_anchors(path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation but - and _ dropped, spaces as -."""
    text = re.sub(r"(?ms)^```.*?^```[^\n]*$", "", path.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_relative_link_in_the_readme_and_guides_reaches_a_file_and_heading_that_exist():
    """Moving a section between the README and docs/ cannot leave a link behind it: each relative link's file exists
    and, for a markdown file, so does the heading its #anchor names."""
    broken = []
    for doc in (README, *GUIDES):
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: leave the checkout
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readme_links_every_guide_in_docs():
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", _without_code(README.read_text()))}
    assert [str(g.relative_to(ROOT)) for g in GUIDES if g.resolve() not in linked] == []


def test_the_readme_is_a_front_page_of_at_most_150_lines():
    assert len(README.read_text().splitlines()) <= FRONT_PAGE_LINES, "move the new section to a guide in docs/"


def test_the_readmes_first_fenced_block_holds_the_two_commands_ci_runs():
    """A newcomer's first screen holds the two commands, byte for byte those .ci/run runs on a clean clone."""
    text = README.read_text()
    block = re.search(r"(?ms)^```\w*\n(.*?)^```", text)
    assert text[:block.start()].count("\n") < 12, "the two commands are the first thing under the title"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["scripts/setup && .venv/bin/study demo", "scripts/test"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ["scripts/setup", ".venv/bin/study demo", "exec scripts/test"] == [
        line for line in ci if line in ("scripts/setup", ".venv/bin/study demo", "exec scripts/test")]
