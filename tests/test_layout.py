"""The package's shape: layers that hold for every import (function-local and `TYPE_CHECKING` ones included), over
`study/` and `analysis/`, and no import cycle between modules.

Data flows plan -> spec -> launch -> job: a job reads the spec the planner wrote and never imports the planner.
The layers, lowest first (docs/ARCHITECTURE.md draws them):
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("study", "analysis")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("study", "study.errors"),  # user errors: what is wrong, which field, the fix
    ("study.console", "study.files"),  # tables; files written whole and locked, records read back checked
    ("study.schema",),  # names other tools rely on: MLflow tags, metric names, the run directory
    ("study.config",),  # typed configs, the run key, the run spec, secret masking
    ("study.models", "study.data", "study.geometry", "study.track"),  # pure libraries, each on its own
    ("study.train",),  # the training loop and what it needs to resume
    ("study.eval", "study.export"),  # reading trained runs: lm-eval's adapter, export formats
    ("study.plan", "study.jobs"),  # the planner; what a job does with a run directory
    ("analysis",),  # reading a study back from MLflow: decisions, fits, the report
    ("study.launch",),  # submitting jobs, the queue's view, status
    ("study.parser",),  # the command line's shape and a command's own key=value options
    ("study.cli", "study.train.__main__", "study.eval.__main__"),  # entry points
)
"""A module may import from its own package (the longest prefix it matches here) or from a lower layer; packages
that share a layer never import each other."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Modules of the project that `path` imports anywhere: at import time, inside functions, for type checking."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in PACKAGES:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {m: {i for i in imports(p) if i in files and i != m} for m, p in files.items()}


def home(module: str) -> tuple[int, str]:
    """(layer, package) of a module: the longest entry of LAYERS it falls under."""
    found = [(len(p), i, p) for i, layer in enumerate(LAYERS) for p in layer
             if module == p or module.startswith(p + ".")]
    assert found, f"{module} is in no layer: add its package to LAYERS"
    _, layer, package = max(found)
    return layer, package


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_layout_rules_see_function_local_imports():
    """The graph the rules read includes imports inside functions: the loop imports the data loader lazily."""
    g = graph()
    assert "study.data" in g["study.train.loop"]
    assert "study.jobs.eval" in g["study.launch.callables"]


def test_no_import_cycles_counting_every_import():
    assert cycles(graph()) == []


def test_every_import_goes_down_the_layers():
    upward = []
    for m, deps in sorted(graph().items()):
        layer, package = home(m)
        for d in sorted(deps):
            d_layer, d_package = home(d)
            if d_package != package and d_layer >= layer:
                upward.append(f"{m} -> {d}")
    assert upward == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_jobs_never_import_the_planner():
    g = graph()
    # entry points (`python -m study.train`, like the CLI) plan a run before handing its spec to the loop
    libraries = ("study.train", "study.eval", "study.geometry", "study.models", "study.data", "study.track",
                 "study.config", "study.jobs", "study.export")
    upward = {m: sorted(i for i in deps if i.startswith("study.plan")) for m, deps in g.items()
              if m.startswith(libraries) and not m.endswith("__main__")}
    assert {m: v for m, v in upward.items() if v} == {}
    assert any(i.startswith("study.config.spec") for i in g["study.train.loop"])  # the loop reads a spec
