"""Tokenising a corpus into its shard entry as a stream, resumable after a kill; the entry's on-disk format, which
the reader (`shards`) shares.

Documents are read pass by pass, `data.chunk_docs` at a time, encoded in one batched call and appended to
`train.bin` / `val.bin`; after each chunk the files are fsync'd and `progress.json` records atomically where the
stream stands and each file's length. A resumed build cuts the files back to the record and goes on from its
document, so it writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from study.config.data import DataConfig
from study.data.cache import sha256_file
from study.data.sources import Layout, Source, capped
from study.data.tokenizer import TokenizerFile, load_tokenizer
from study.files import COUNT, MAPPING, NUMBER, damaged, read_mapping, replace_file, shape_problem

PROGRESS = "progress.json"
SHARD_FORMAT = 2
"""Version of the entry layout; an entry of another version is rebuilt, never misread."""
CHECKED = ("train.bin", "val.bin", "tokenizer.json")
"""Files whose SHA-256 the entry's meta.json records (what a run's data record compares)."""
SPLITS = ("train", "val")
"""The splits every entry holds, in this order."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_shards(out: Path, source: Source, parts: Layout, tok: TokenizerFile, cfg: DataConfig,
                 progress: bool = False, after_chunk: Callable[[int], None] | None = None) -> None:
    """Tokenise both splits into the build directory `out` (renamed into the cache once this returns)."""
    from tqdm import tqdm

    if cfg.num_proc:
        # the tokenizer's thread pool reads this when it starts (a BPE trained in this process has started it)
        os.environ["RAYON_NUM_THREADS"] = str(cfg.num_proc)
    dtype = token_dtype(tok.vocab_size)
    state = _resume(out, dtype)
    encoder = load_tokenizer(tok.path)
    with ExitStack() as stack:
        files = {name: stack.enter_context(open(out / f"{name}.bin", "ab")) for name in SPLITS}
        caps = [p.max_docs for p in parts.passes]
        bar = stack.enter_context(tqdm(
            total=sum(caps) if None not in caps else None, unit=" docs", desc=f"tokenising {cfg.name}",
            initial=sum(parts.passes[i].max_docs or 0 for i in range(state["pass"])) + state["docs"],
            file=sys.stderr, disable=not progress, mininterval=1.0, dynamic_ncols=True))
        for index in range(state["pass"], len(parts.passes)):
            p = parts.passes[index]
            if index != state["pass"]:
                state.update({"pass": index, "docs": 0, "bytes": 0})
            texts = itertools.chain.from_iterable(capped(source, p, state["docs"], state["bytes"]))
            while chunk := list(itertools.islice(texts, cfg.chunk_docs)):
                _write_chunk(chunk, p, state, encoder, tok.eos_id, dtype, files, out, bar)
                if after_chunk:
                    after_chunk(state["chunks"])
    shutil.copyfile(tok.path, out / "tokenizer.json")
    tokens = sum(s["tokens"] for s in state["splits"].values())
    meta = {
        "format": SHARD_FORMAT, "dtype": dtype.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
        "source": {"name": cfg.name, "config_name": cfg.config_name, "text_field": cfg.text_field,
                   "val_from": parts.val_from, "max_docs": cfg.max_docs, "max_bytes": cfg.max_bytes},
        "tokenizer": str(tok.path), "splits": state["splits"],
        "tokenize_seconds": round(state["seconds"], 3),
        "tokenize_tokens_per_s": round(tokens / max(state["seconds"], 1e-9)),
    }
    meta["sha256"] = {name: sha256_file(out / name) for name in CHECKED}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    (out / PROGRESS).unlink(missing_ok=True)


def _resume(out: Path, dtype: np.dtype) -> dict[str, Any]:
    """The progress record of an interrupted build (its token files cut back to it), or a fresh one."""
    record = out / PROGRESS
    if not record.is_file():
        for name in SPLITS:
            (out / f"{name}.bin").unlink(missing_ok=True)
        return {"pass": 0, "docs": 0, "bytes": 0, "chunks": 0, "seconds": 0.0,
                "splits": {name: {"documents": 0, "bytes": 0, "tokens": 0} for name in SPLITS}}
    # refused by name when damaged: its counts cut the token files back
    fix = f"delete {out}: the next `study prepare` (or launch) tokenises the corpus from the start"
    state = read_mapping(record, {"pass": COUNT, "docs": COUNT, "bytes": COUNT, "chunks": COUNT, "seconds": NUMBER,
                                  "splits": MAPPING}, fix)
    for name in SPLITS:
        problem = shape_problem(state["splits"].get(name), {"documents": COUNT, "bytes": COUNT, "tokens": COUNT})
        if problem:
            raise damaged(record, f"splits.{name} {problem}", fix)
    for name in SPLITS:
        with open(out / f"{name}.bin", "ab") as f:
            f.truncate(state["splits"][name]["tokens"] * dtype.itemsize)
    print(f"resuming the tokenisation in {out} at document {state['docs']} of pass {state['pass'] + 1} "
          f"({sum(s['tokens'] for s in state['splits'].values())} tokens written)", file=sys.stderr, flush=True)
    return state


def _write_chunk(texts: list[str], p, state: dict[str, Any], encoder, eos_id: int, dtype: np.dtype,
                 files: dict, out: Path, bar) -> None:
    start = time.perf_counter()
    first = state["docs"]
    by_split: dict[str, list[str]] = {name: [] for name in SPLITS}
    for i, text in enumerate(texts, first):
        by_split[p.target(i)].append(text)
    for name, docs in by_split.items():
        if not docs:
            continue
        encoded = encoder.encode_batch_fast(docs, add_special_tokens=False)
        eos = np.array([eos_id], dtype=dtype)
        pieces = [piece for e in encoded for piece in (np.asarray(e.ids, dtype=dtype), eos)]
        flat = np.concatenate(pieces)
        files[name].write(flat.tobytes())
        stats = state["splits"][name]
        stats["documents"] += len(docs)
        stats["bytes"] += sum(len(t.encode()) for t in docs)
        stats["tokens"] += len(flat)
    for f in files.values():
        f.flush()
        os.fsync(f.fileno())
    state["docs"] += len(texts)
    state["bytes"] += sum(len(t.encode()) for t in texts)
    state["chunks"] += 1
    state["seconds"] += time.perf_counter() - start
    replace_file(out / PROGRESS, json.dumps(state))  # the record only ever names bytes that are on disk
    tokens = sum(s["tokens"] for s in state["splits"].values())
    bar.update(len(texts))
    bar.set_postfix_str(f"{tokens:,} tokens, {tokens / max(state['seconds'], 1e-9) / 1e6:.2f} M tokens/s",
                        refresh=False)
