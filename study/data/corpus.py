"""The embedded default corpus: English docstrings of the Python standard library, offline and licence-clean on any
machine; a sorted walk and pure filters give the same JSONL file, byte for byte, for one Python version."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from study.data.cache import build_once, cache_key

# Test suites are mostly "Test that X" one-liners and dominate the walk's time; site-packages is not
# the standard library and would make the corpus depend on what happens to be installed.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MIN_CHARS = 48
MAX_CHARS = 16_000
STOPWORDS = frozenset("the a an of to is and in for this that it be with as are by on or if not from".split())
WORD = re.compile(r"[A-Za-z]+")
NOT_LETTER = re.compile(r"[^A-Za-z\s]")
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def is_english_prose(text: str) -> bool:
    """Mostly ASCII letters, with English function words at the rate of running prose, of reasonable length."""
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return False
    words = WORD.findall(text)
    if len(words) < 6:
        return False
    ascii_share = len(text.encode("ascii", "ignore")) / len(text)
    letter_share = 1.0 - len(NOT_LETTER.findall(text)) / len(text)
    stop_share = sum(w.lower() in STOPWORDS for w in words) / len(words)
    return ascii_share >= 0.97 and letter_share >= 0.6 and stop_share >= 0.08


def docstrings(path: Path) -> Iterator[str]:
    """Module, class and function docstrings of one file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in _definitions(tree):
        text = ast.get_docstring(node, clean=True)
        if text:
            yield text


def _definitions(node: ast.AST) -> Iterator[ast.AST]:
    """The module and every class or function in it, in source order, without descending into expressions."""
    if isinstance(node, DOC_NODES):
        yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            yield from _definitions(child)


def docstring_documents(root: Path, max_docs: int | None = None, max_bytes: int | None = None) -> Iterator[str]:
    """Distinct English docstrings of the Python files under `root`, walked in a machine-independent sorted order,
    stopping at the caps."""
    seen: set[str] = set()
    total = 0
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            for text in docstrings(Path(here) / name):
                if text in seen or not is_english_prose(text):
                    continue
                seen.add(text)
                yield text
                total += len(text.encode())
                if (max_docs and len(seen) >= max_docs) or (max_bytes and total >= max_bytes):
                    return


def build_docstring_corpus(cache: Path, max_docs: int | None = None, max_bytes: int | None = None) -> Path:
    """Write (once) the docstring corpus as JSONL with a `text` field and return the file's path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    version = ".".join(map(str, sys.version_info[:3]))
    key = cache_key("docstrings", 1, version, str(root), max_docs, max_bytes)
    entry = cache / "corpus" / f"docstrings-py{version}-{key}"

    def build(tmp: Path) -> None:
        with open(tmp / "docstrings.jsonl", "w", encoding="utf-8") as out:
            for text in docstring_documents(root, max_docs, max_bytes):
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")

    return build_once(entry, build) / "docstrings.jsonl"
