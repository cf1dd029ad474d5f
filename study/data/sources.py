"""Where documents come from, read as a stream: the embedded corpus, a `save_to_disk` directory, local data files
or a Hugging Face hub dataset (`datasets.load_dataset(..., streaming=True)`: the same documents in the same order as
a full load, fetched only as far as the caps reach). What goes where is a list of passes (:class:`Pass`) over source
splits, each document of a pass going to `train` or `val`. `datasets` is imported lazily.

The embedded default corpus is English docstrings of the Python standard library, offline and licence-clean on any
machine; a sorted walk and pure filters give the same JSONL file, byte for byte, for one Python version.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import math
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from study.config.data import EMBEDDED, VAL_SPLIT_SEED, DataConfig, cache_root
from study.data.cache import build_once, cache_key, fingerprint_path
from study.data.flat import flat_key
from study.errors import StudyError

T = TypeVar("T")
READ_BATCH = 1000
UNREADABLE = (OSError, ValueError)
"""How `datasets` and Arrow fail on a damaged corpus: OSError (a damaged page), ValueError (ArrowInvalid, a line cut
short; UnicodeDecodeError)."""
# Test suites are mostly "Test that X" one-liners and dominate the walk's time; site-packages is not
# the standard library and would make the corpus depend on what happens to be installed.
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MIN_CHARS = 48
MAX_CHARS = 16_000
STOPWORDS = frozenset("the a an of to is and in for this that it be with as are by on or if not from".split())
WORD = re.compile(r"[A-Za-z]+")
NOT_LETTER = re.compile(r"[^A-Za-z\s]")
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Pass:
    """One read of a source split, from its first document, up to the caps."""

    split: str
    """The source split read."""
    max_docs: int | None
    """Stop after this many documents (None: no limit)."""
    max_bytes: int | None
    """Stop after the document whose UTF-8 text reaches this many bytes in total (None: no limit)."""
    to: str
    """`train` or `val`: where every document of the pass goes, unless `held_out` says otherwise."""
    held_out: np.ndarray | None = None
    """For a fraction split: True at the document indices held out for validation (the rest is `train`)."""

    def target(self, index: int) -> str:
        if self.held_out is None:
            return self.to
        return "val" if self.held_out[index] else "train"


@dataclass(frozen=True)
class Layout:
    passes: list[Pass]
    """The passes that together yield both splits, in order."""
    val_from: str
    """Where the validation documents come from: the dataset's named split or `fraction`."""


def source_key(cfg: DataConfig) -> str:
    """Identity of the documents without loading them: name, config, split rule, caps, local file stats (flat token
    files: :func:`study.data.flat.flat_key`)."""
    if cfg.tokens is not None:
        return flat_key(cfg)
    local = Path(cfg.name).expanduser()
    stats = fingerprint_path(local) if cfg.name != EMBEDDED and local.exists() else None
    return cache_key(cfg.name, cfg.config_name, cfg.text_field, cfg.train_split, cfg.val_split,
                     cfg.val_fraction, cfg.max_docs, cfg.max_bytes, stats)


class Source:
    """The documents of one data config: which splits exist, and a stream of texts per split."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        local = Path(cfg.name).expanduser()
        if cfg.name == EMBEDDED:
            self.kind, self.path = "jsonl", build_docstring_corpus(cache_root(cfg), cfg.max_docs, cfg.max_bytes)
        elif local.is_dir() and any((local / f).exists() for f in ("dataset_dict.json", "state.json")):
            self.kind, self.path = "disk", local
        else:
            self.kind, self.path = "stream", local

    @functools.cached_property
    def splits(self) -> dict[str, Any]:
        """Split name -> a `datasets` object (or, for the embedded corpus, its JSONL path), opened on first use."""
        cfg = self.cfg
        if self.kind == "jsonl":  # read line by line: no need to import `datasets` (0.6 s in every training process)
            return {cfg.train_split: self.path}
        import datasets

        if self.kind == "disk":
            loaded = datasets.load_from_disk(str(self.path))
        else:
            name = str(self.path) if self.path.exists() else cfg.name
            try:
                loaded = datasets.load_dataset(name, cfg.config_name, streaming=True,
                                               cache_dir=str(cache_root(cfg) / "hf"))
            except (FileNotFoundError, ValueError, ConnectionError) as err:
                raise StudyError("data.name", f"cannot read the dataset {cfg.name!r} ({_first_line(err)})",
                                 f"give a local data directory, a `save_to_disk` directory, a hub dataset "
                                 f"reachable from here, or `{EMBEDDED}`") from None
            except StopIteration:  # the JSON builder reads its first file's first rows for the columns: there are none
                raise StudyError("data.name", f"the dataset {cfg.name!r} begins with an empty data file",
                                 "remove the empty file, or give the corpus's directory of non-empty files") from None
        if isinstance(loaded, (datasets.Dataset, datasets.IterableDataset)):
            return {cfg.train_split: loaded}
        return dict(loaded)

    def check(self) -> None:
        """The training split and the text column exist (read from the first document at most)."""
        cfg, splits = self.cfg, self.splits
        if cfg.train_split not in splits:
            raise StudyError("data.train_split", f"{cfg.name} has no split {cfg.train_split!r} (it has "
                             f"{sorted(splits)})", f"use one of {sorted(splits)}")
        for split in {cfg.train_split, cfg.val_split} & set(splits) if self.kind != "jsonl" else ():
            ds = splits[split]
            columns = ds.column_names
            if columns is None:  # a stream whose features are unknown until read: its first document says
                first = next(self._readable(lambda: ds.take(1)), None)
                columns = None if first is None else list(first)
            if columns is not None and cfg.text_field not in columns:
                raise StudyError("data.text_field", f"{cfg.name} has no column {cfg.text_field!r} (it has "
                                 f"{columns})", f"use one of {columns}")

    def _readable(self, read: Callable[[], Iterable[T]]) -> Iterator[T]:
        """What `read()` yields; a corpus that cannot be read (cut short, not UTF-8, a damaged parquet page) is refused
        naming data.name.

        The refusal is raised after leaving the `except` block, so the failed Arrow reader (whose threads may still be
        reading) is freed then, not at interpreter exit, where a live scan aborts the process."""
        try:
            yield from read()
        except UNREADABLE as err:
            failure = StudyError("data.name", f"the dataset {self.cfg.name!r} cannot be read ({_first_line(err)})",
                                 "repair or download again the damaged or empty file (JSON lines must be whole lines "
                                 "of UTF-8 JSON, parquet files whole), or remove it: a changed file is read afresh")
        else:
            return
        raise failure

    def texts(self, split: str, start: int = 0, size: int = READ_BATCH) -> Iterator[list[str]]:
        """Batches of `size` of the split's texts from document `start` on, in source order (null: empty)."""
        ds, field = self.splits[split], self.cfg.text_field

        def read() -> Iterator[list[str]]:
            if self.kind != "jsonl":
                for table in self._tables(split, start, size):
                    yield [t or "" for t in table.column(field).to_pylist()]
                return
            with open(ds, encoding="utf-8") as f:
                lines = itertools.islice(f, start, None)
                while batch := [json.loads(line).get(field) or "" for line in itertools.islice(lines, size)]:
                    yield batch

        yield from self._readable(read)

    def byte_lengths(self, split: str, size: int = READ_BATCH) -> Iterator[np.ndarray]:
        """The UTF-8 length of each text, batch by batch, computed in Arrow (no text becomes a Python string)."""
        if self.kind == "jsonl":
            for batch in self.texts(split, 0, size):
                yield np.array([len(t.encode()) for t in batch], dtype=np.int64)
            return
        import pyarrow.compute as pc

        yield from self._readable(lambda: (
            pc.fill_null(pc.binary_length(table.column(self.cfg.text_field)), 0).to_numpy().astype(np.int64)
            for table in self._tables(split, 0, size)))

    def _tables(self, split: str, start: int, size: int):
        """Arrow tables of `size` rows of the text column from row `start` on."""
        ds, field = self.splits[split], self.cfg.text_field
        if self.kind == "disk":
            arrow = ds.select_columns([field]).with_format("arrow")
            for lo in range(start, len(ds), size):
                yield arrow[lo:lo + size]
        else:
            stream = ds.select_columns([field])
            yield from (stream.skip(start) if start else stream).with_format("arrow").iter(batch_size=size)


def capped(source: Source, p: Pass, start: int = 0, start_bytes: int = 0) -> Iterator[list[str]]:
    """The pass's texts from document `start` (with `start_bytes` of text before it) up to its caps."""
    index, total = start, start_bytes
    for batch in source.texts(p.split, start, _batch_size(p, start)):
        keep = []
        for text in batch:
            if (p.max_docs is not None and index >= p.max_docs) or (p.max_bytes is not None and total >= p.max_bytes):
                break
            keep.append(text)
            total += len(text.encode())
            index += 1
        if keep:
            yield keep
        if len(keep) < len(batch) or index == p.max_docs:
            return


def _batch_size(p: Pass, start: int = 0) -> int:
    """Documents read at a time: never past the document cap, so a stream is read (or downloaded) no further."""
    return READ_BATCH if p.max_docs is None else max(1, min(READ_BATCH, p.max_docs - start))


def count(source: Source, p: Pass) -> int:
    """How many documents the pass keeps: the caps of :func:`capped`, applied to text lengths alone."""
    n, total = 0, 0
    for lengths in source.byte_lengths(p.split, _batch_size(p)):
        if p.max_docs is not None:
            lengths = lengths[:p.max_docs - n]
        if p.max_bytes is not None:
            before = total + np.cumsum(lengths) - lengths  # text bytes ahead of each document
            kept = int(np.searchsorted(before, p.max_bytes, side="left"))  # those that start under the cap
            if kept < len(lengths):
                return n + kept
        n += len(lengths)
        total += int(lengths.sum())
        if n == p.max_docs:
            break
    return n


def layout(cfg: DataConfig, source: Source) -> Layout:
    """The passes that give train and validation documents (a fraction split first counts the capped training
    documents, reading text lengths only)."""
    source.check()
    splits = source.splits
    if cfg.val_split in splits and cfg.val_split != cfg.train_split:
        return Layout([Pass(cfg.train_split, cfg.max_docs, cfg.max_bytes, "train"),
                       Pass(cfg.val_split, _share(cfg.max_docs, cfg.val_fraction),
                            _share(cfg.max_bytes, cfg.val_fraction), "val")], cfg.val_split)
    probe = Pass(cfg.train_split, cfg.max_docs, cfg.max_bytes, "train")
    if cfg.max_bytes is not None or source.kind != "disk":  # a byte cap needs the texts
        n = count(source, probe)
    else:  # the capped split's length is known without reading texts
        n = len(splits[cfg.train_split]) if cfg.max_docs is None else min(len(splits[cfg.train_split]), cfg.max_docs)
    if n < 2:
        raise StudyError("data.max_docs", f"{n} training document(s) cannot be split into train and validation",
                         "keep at least two documents")
    n_val = min(n - 1, max(1, round(n * cfg.val_fraction)))
    order = np.random.Generator(np.random.PCG64(VAL_SPLIT_SEED)).permutation(n)
    held_out = np.zeros(n, dtype=bool)
    held_out[order[:n_val]] = True
    return Layout([Pass(cfg.train_split, n, None, "train", held_out)], "fraction")


def _first_line(err: BaseException) -> str:
    """The exception's type and the first line of its message (Arrow's and datasets' can run to pages)."""
    text = str(err).splitlines()[0][:300] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _share(cap: int | None, fraction: float) -> int | None:
    return None if cap is None else max(1, math.ceil(cap * fraction))


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
