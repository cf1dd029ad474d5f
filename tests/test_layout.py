"""The package's shape: data flows plan -> spec -> launch -> job, with no import cycles and no stage importing the
planner; modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "study"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool) -> set[str]:
    """Modules of the `study` package that `path` imports (at import time only, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks and the like also run at import time
        nodes = [n for top in tree.body for n in ast.walk(top) if not isinstance(top, (ast.FunctionDef, ast.ClassDef))]
        nodes += [n for top in tree.body if isinstance(top, ast.ClassDef) for n in top.body
                  if isinstance(n, (ast.Import, ast.ImportFrom))]
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("study"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("study"))
    return out


def graph(top_level_only: bool) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in imports(p, top_level_only) if i in files and i != m} for m, p in files.items()}


def test_no_import_cycles_at_import_time():
    g = graph(top_level_only=True)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n] if n in stack else [m, n])
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_jobs_never_import_the_planner():
    g = graph(top_level_only=False)
    stages = ("study.train", "study.evaluate", "study.geometry", "study.models", "study.data", "study.track",
              "study.config")
    # entry points (`python -m study.train`, like the CLI) plan a run before handing its spec to the loop
    upward = {m: sorted(i for i in deps if i.startswith("study.plan")) for m, deps in g.items()
              if m.startswith(stages) and not m.endswith("__main__")}
    assert {m: v for m, v in upward.items() if v} == {}
    assert any(i.startswith("study.config.spec") for i in g["study.train.loop"])  # the loop reads a spec


def test_modules_stay_small():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {m: n for m, n in sizes.items() if n > 400} == {}
