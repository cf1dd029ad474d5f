"""Token shards: each split tokenised once into a flat memory-mapped array of ids, documents joined by EOS.

A shard directory is keyed by (documents, tokenizer) and holds `train.bin`, `val.bin` (raw uint16 when
the vocabulary fits, else uint32), the `tokenizer.json` that produced them and `meta.json` with each file's
SHA-256. Every run of a sweep opens the same files read-only; nothing is tokenised twice. A file is checked
against its checksum when it is first opened and again whenever its size or modification time changes
(`.verified` records what was checked); an entry that fails is moved away and built again, saying so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from study.data.cache import build_once, cache_key, file_lock
from study.config.data import DataConfig, cache_root, tokenize_procs, validate_data
from study.data.sources import Splits, load_splits, source_key
from study.data.tokenizer import TokenizerFile, load_tokenizer, resolve_tokenizer
from study.errors import StudyError

if TYPE_CHECKING:
    import pyarrow as pa
    from datasets import Dataset

SHARD_FORMAT = 2
CHECKED = ("train.bin", "val.bin", "tokenizer.json")
MAP_BATCH = 1000
SPLITS = ("train", "val")


@dataclass(frozen=True)
class PreparedData:
    train: np.memmap
    """Training token ids, documents joined by EOS."""
    val: np.memmap
    """Held-out token ids, never seen in training."""
    tokenizer_path: Path
    """The tokenizer.json that produced the shards (a copy kept beside them)."""
    vocab_size: int
    """Number of ids the tokenizer can emit; the model's embedding must have at least this many rows."""
    eos_id: int
    """Id placed after every document."""
    seq_len: int
    """Tokens per sequence the batches are cut to."""
    shard_dir: Path
    """Cache directory holding the shards and meta.json."""
    meta: dict[str, Any]
    """What was tokenised: source, per-split documents/bytes/tokens, tokenisation throughput."""


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Token shards for `cfg`, tokenised on first use and opened from the cache afterwards."""
    validate_data(cfg)
    cache = cache_root(cfg)
    documents = source_key(cfg)
    splits = functools.cache(lambda: load_splits(cfg))
    tok = resolve_tokenizer(cfg, cache, documents, lambda: splits().train)
    entry = cache / "shards" / f"{_slug(cfg.name)}-{cache_key(documents, tok.key, SHARD_FORMAT)}"
    build = lambda tmp: write_shards(tmp, splits(), tok, cfg)  # noqa: E731
    build_once(entry, build)
    try:
        return open_shards(entry, cfg.seq_len)
    except BrokenEntry as broken:
        import sys

        print(f"shard cache entry {entry} is damaged ({broken}); building it again", file=sys.stderr, flush=True)
        discard(entry)
        build_once(entry, build)
        return open_shards(entry, cfg.seq_len)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_shards(out: Path, splits: Splits, tok: TokenizerFile, cfg: DataConfig) -> None:
    """Tokenise both splits into `out` (a temporary directory the cache renames once this returns)."""
    dtype = token_dtype(tok.vocab_size)
    start = time.perf_counter()
    stats = {name: _tokenize_split(docs, out, name, tok, cfg, dtype)
             for name, docs in zip(SPLITS, (splits.train, splits.val))}
    seconds = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in stats.values())
    shutil.copyfile(tok.path, out / "tokenizer.json")
    meta = {
        "format": SHARD_FORMAT, "dtype": dtype.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
        "source": {"name": cfg.name, "config_name": cfg.config_name, "text_field": cfg.text_field,
                   "val_from": splits.val_from, "max_docs": cfg.max_docs, "max_bytes": cfg.max_bytes},
        "tokenizer": str(tok.path), "splits": stats,
        "tokenize_seconds": round(seconds, 3), "tokenize_tokens_per_s": round(tokens / max(seconds, 1e-9)),
    }
    meta["sha256"] = {name: sha256_file(out / name) for name in CHECKED}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))


class BrokenEntry(Exception):
    """A cache entry whose files are missing, unreadable or not what its checksums say."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def verify(entry: Path) -> dict[str, Any]:
    """The entry's meta.json, after checking every file whose size or modification time changed since it was last
    verified against its SHA-256."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        sums = meta["sha256"]
        stamp_path = entry / ".verified"
        stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else {}
        seen = {}
        for name in CHECKED:
            st = (entry / name).stat()
            seen[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
            if stamp.get(name) != seen[name] and sha256_file(entry / name) != sums[name]:
                raise BrokenEntry(f"{name} does not match its checksum")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BrokenEntry(f"{type(err).__name__}: {err}") from None
    if stamp != seen:
        tmp = stamp_path.with_name(f".verified.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(seen))
            os.replace(tmp, stamp_path)
        except OSError:
            pass  # a read-only cache is still verified, only again next time
    return meta


def discard(entry: Path) -> None:
    """Move a damaged entry out of the way (open memory maps of it stay valid) and delete it."""
    import uuid

    with file_lock(entry.with_name(entry.name + ".lock")):
        if entry.is_dir():
            gone = entry.with_name(f"{entry.name}.broken-{uuid.uuid4().hex[:8]}")
            os.rename(entry, gone)
            shutil.rmtree(gone, ignore_errors=True)


def open_shards(entry: Path, seq_len: int) -> PreparedData:
    meta = verify(entry)
    arrays = {name: np.memmap(entry / f"{name}.bin", dtype=meta["dtype"], mode="r",
                              shape=(meta["splits"][name]["tokens"],)) for name in SPLITS}
    for name, tokens in arrays.items():
        if len(tokens) < seq_len + 1:
            raise StudyError("data.seq_len", f"the {name} split has {len(tokens)} tokens, fewer than one window of "
                             f"seq_len + 1 = {seq_len + 1}", "lower data.seq_len, or keep more documents "
                             "(data.max_docs, data.max_bytes, data.val_fraction)")
    return PreparedData(arrays["train"], arrays["val"], entry / "tokenizer.json", meta["vocab_size"],
                        meta["eos_id"], seq_len, entry, meta)


class _Encoder:
    """Batched `datasets.map` function; pickles as a path so each worker process loads its own tokenizer."""

    def __init__(self, path: Path, text_field: str, eos_id: int):
        self.path, self.text_field, self.eos_id = path, text_field, eos_id
        self._tok = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, batch: dict[str, list]) -> dict[str, list[list[int]]]:
        if self._tok is None:
            self._tok = load_tokenizer(self.path)
        texts = [text or "" for text in batch[self.text_field]]
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        return {"ids": [e.ids + [self.eos_id] for e in encoded]}


def _tokenize_split(docs: Dataset, out: Path, name: str, tok: TokenizerFile, cfg: DataConfig,
                    dtype: np.dtype) -> dict[str, int]:
    import pyarrow.compute as pc
    from datasets import Features, Sequence, Value

    work = out / "arrow"
    work.mkdir(exist_ok=True)
    procs = min(tokenize_procs(cfg), -(-len(docs) // MAP_BATCH))
    ids = docs.map(_Encoder(tok.path, cfg.text_field, tok.eos_id), batched=True, batch_size=MAP_BATCH,
                   num_proc=procs if procs > 1 else None, remove_columns=docs.column_names,
                   features=Features({"ids": Sequence(Value("uint32"))}),
                   cache_file_name=str(work / f"{name}.arrow"), new_fingerprint=cache_key(out.name, name),
                   desc=f"tokenising {name}")
    total = sum(int(pc.sum(pc.list_value_length(b.column("ids"))).as_py()) for b in _arrow_batches(ids))
    shard = np.memmap(out / f"{name}.bin", dtype=dtype, mode="w+", shape=(total,))
    pos = 0
    for batch in _arrow_batches(ids):
        flat = pc.list_flatten(batch.column("ids")).to_numpy()
        shard[pos:pos + len(flat)] = flat
        pos += len(flat)
    shard.flush()
    del shard, ids
    shutil.rmtree(work)
    text_bytes = sum(int(pc.sum(pc.binary_length(b.column(cfg.text_field))).as_py() or 0)
                     for b in _arrow_batches(docs))
    return {"documents": len(docs), "bytes": text_bytes, "tokens": total}


def _arrow_batches(ds: Dataset) -> Iterator[pa.Table]:
    return ds.with_format("arrow").iter(batch_size=100 * MAP_BATCH)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", Path(name).name if Path(name).expanduser().exists() else name)[-48:]
