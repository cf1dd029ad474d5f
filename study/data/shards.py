"""Token shards: each split tokenised once into a flat memory-mapped array of ids, documents joined by EOS.

An entry, keyed by (documents, tokenizer), holds `train.bin`, `val.bin`, the `tokenizer.json` that produced them and
`meta.json` with their SHA-256, checked when first opened and whenever a file's size or mtime changes (`.verified`);
a damaged entry is built again, saying so. Flat token files (`data.tokens`, :mod:`study.data.flat`) are read in place.

The corpus is tokenised into its entry as a stream, resumable after a kill: documents are read pass by pass,
`data.chunk_docs` at a time, encoded in one batched call and appended to `train.bin` / `val.bin`; after each chunk the
files are fsync'd and `progress.json` records atomically where the stream stands and each file's length. A resumed
build cuts the files back to the record and goes on from its document, so it writes the same bytes as an
uninterrupted one.
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from study.config.data import TRAIN_BPE, DataConfig, cache_root, validate_data
from study.data.cache import build_once, cache_key, sha256_file
from study.files import COUNT, MAPPING, NUMBER, damaged, file_lock, read_mapping, replace_file, shape_problem
from study.data.flat import TokenStream, flat_streams, write_flat
from study.data.sources import Layout, Source, capped, layout, source_key
from study.data.tokenizer import TokenizerFile, load_tokenizer, resolve_tokenizer
from study.errors import StudyError

PROGRESS = "progress.json"
SHARD_FORMAT = 2
"""Version of the entry layout; an entry of another version is rebuilt, never misread."""
CHECKED = ("train.bin", "val.bin", "tokenizer.json")
"""Files whose SHA-256 the entry's meta.json records (what a run's data record compares)."""
SPLITS = ("train", "val")
"""The splits every entry holds, in this order."""


@dataclass(frozen=True)
class PreparedData:
    train: np.memmap | TokenStream
    """Training token ids, documents joined by EOS (flat token files: their stream, read in place)."""
    val: np.memmap | TokenStream
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
    """What was tokenised: source, per-split documents/bytes/tokens, tokenisation throughput (flat token files: the
    scanned files, per-split tokens, the largest id)."""


def prepare_data(cfg: DataConfig, model_vocab: int | None = None, build: bool = True, progress: bool = False,
                 after_chunk: Callable[[int], None] | None = None) -> PreparedData:
    """Token shards for `cfg`, tokenised (or, flat token files, scanned) on first use and opened from the cache after.
    `model_vocab` must cover the tokenizer, checked before anything is written; with `build=False` missing shards are
    an error naming `study prepare`; `after_chunk(n)` runs after each finished chunk or scanned file."""
    validate_data(cfg)
    cache = cache_root(cfg)
    with _writing(cache):
        documents = source_key(cfg)
        if cfg.tokenizer == TRAIN_BPE and model_vocab is not None and cfg.vocab_size > model_vocab:
            # refused before the BPE is trained; the trained vocabulary is checked exactly below
            raise StudyError("model.vocab_size", f"{model_vocab} rows cannot embed the {cfg.vocab_size} ids of the BPE "
                             "(data.vocab_size)", f"set model.vocab_size >= {cfg.vocab_size} or lower data.vocab_size")
        source = functools.cache(lambda: Source(cfg))
        parts = functools.cache(lambda: layout(cfg, source()))
        tok = resolve_tokenizer(cfg, cache, documents, lambda: _train_texts(source(), parts()), build=build)
        entry = None if tok is None else shard_entry(cfg, documents, tok)
        if not build and (entry is None or not entry.is_dir()):
            raise StudyError("data", f"the token shards of {cfg.name} are not in the cache {cache}",
                             "tokenise them first: `study prepare EXPERIMENT` (or `study prepare data=...` with the "
                             "run's data overrides), or `study launch`, which prepares them")
        check_model_vocab(tok, model_vocab)
        if cfg.tokens is not None:
            build_fn = lambda tmp: write_flat(tmp, cfg, tok, progress, after_chunk)  # noqa: E731
        else:
            if not entry.is_dir():
                parts()  # the splits and the text column exist, before the build directory is made
            build_fn = lambda tmp: write_shards(tmp, source(), parts(), tok, cfg, progress, after_chunk)  # noqa: E731
        build_once(entry, build_fn, resumable=True)
        try:
            return open_entry(entry, cfg)
        except BrokenEntry as broken:
            print(f"shard cache entry {entry} is damaged ({broken}); building it again", file=sys.stderr, flush=True)
            discard(entry)
            build_once(entry, build_fn, resumable=True)
            return open_entry(entry, cfg)


FULL = (errno.ENOSPC, errno.EDQUOT)
UNWRITABLE = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS)


@contextmanager
def _writing(cache: Path) -> Iterator[None]:
    """The cache failing to take a write (full, read-only, a file in the way) is refused naming data.cache_dir."""
    try:
        yield
    except OSError as err:
        if err.errno in FULL:
            raise StudyError("data.cache_dir", f"no space left on {cache} ({os.strerror(err.errno)})",
                             "free space on that file system, or point data.cache_dir (or STUDY_CACHE) at one with "
                             "room: tokenising resumes after its last finished chunk") from None
        if (err.errno in UNWRITABLE and err.filename is not None
                and Path(os.path.abspath(err.filename)).is_relative_to(os.path.abspath(cache))):
            raise StudyError("data.cache_dir", f"cannot write the data cache {cache} ({os.strerror(err.errno)}: "
                             f"{err.filename})", "point data.cache_dir (or STUDY_CACHE) at a writable directory "
                             "(shared between nodes on a cluster)") from None
        raise


def shard_entry(cfg: DataConfig, documents: str, tok: TokenizerFile) -> Path:
    """The cache directory of the shards of (documents, tokenizer); its name is the cache key since format 2."""
    name = Path(cfg.name).name if Path(cfg.name).expanduser().exists() else cfg.name
    slug = re.sub(r"[^A-Za-z0-9._]+", "-", name)[-48:]
    return cache_root(cfg) / "shards" / f"{slug}-{cache_key(documents, tok.key, SHARD_FORMAT)}"


def find_shards(cfg: DataConfig) -> Path | None:
    """The finished shard entry of `cfg` if it is in the cache (nothing is read, trained or tokenised)."""
    documents = source_key(cfg)
    tok = resolve_tokenizer(cfg, cache_root(cfg), documents, lambda: iter(()), build=False)
    entry = None if tok is None else shard_entry(cfg, documents, tok)
    return entry if entry is not None and (entry / "meta.json").is_file() else None


def check_model_vocab(tok: TokenizerFile, model_vocab: int | None) -> None:
    """Before any token is written: the largest id fits the shard dtype, and the model embeds it."""
    if tok.vocab_size > 2**32:
        raise StudyError("data.tokenizer", f"{tok.path} has ids up to {tok.vocab_size - 1}, more than a uint32 shard "
                         "holds", "use a tokenizer whose ids are below 2**32")
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise StudyError("model.vocab_size", f"{model_vocab} rows cannot embed the ids of the tokenizer {tok.path}, "
                         f"up to {tok.vocab_size - 1}", f"set model.vocab_size >= {tok.vocab_size}")


def _train_texts(source: Source, parts: Layout) -> Iterator[list[str]]:
    """The training documents' texts, in batches, as the BPE trainer reads them."""
    for p in parts.passes:
        index = 0
        for batch in capped(source, p):
            keep = [t for i, t in enumerate(batch, index) if p.target(i) == "train"]
            index += len(batch)
            if keep:
                yield keep


class BrokenEntry(Exception):
    """A cache entry whose files are missing, unreadable or not what its checksums say."""


def verify(entry: Path, names: tuple[str, ...] = CHECKED) -> dict[str, Any]:
    """The entry's meta.json, after checking against its SHA-256 every file of `names` changed since last verified."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        sums = meta["sha256"]
        stamp_path = entry / ".verified"
        stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else {}
        seen = {}
        for name in names:
            st = (entry / name).stat()
            seen[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
            if stamp.get(name) != seen[name] and sha256_file(entry / name) != sums[name]:
                raise BrokenEntry(f"{name} does not match its checksum")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BrokenEntry(f"{type(err).__name__}: {err}") from None
    if stamp != seen:
        with suppress(OSError):  # a read-only cache is still verified, only again next time
            replace_file(stamp_path, json.dumps(seen))
    return meta


def discard(entry: Path) -> None:
    """Move a damaged entry out of the way (open memory maps of it stay valid) and delete it."""
    with file_lock(entry.with_name(entry.name + ".lock")):
        if entry.is_dir():
            gone = entry.with_name(f"{entry.name}.broken-{uuid.uuid4().hex[:8]}")
            os.rename(entry, gone)
            shutil.rmtree(gone, ignore_errors=True)


def open_entry(entry: Path, cfg: DataConfig) -> PreparedData:
    """A finished entry's splits, each holding at least one window of seq_len + 1 tokens: memory maps of its shards,
    or (flat token files) streams of the user's files read in place."""
    if cfg.tokens is None:
        meta = verify(entry)
        splits = [np.memmap(entry / f"{name}.bin", dtype=meta["dtype"], mode="r",
                            shape=(meta["splits"][name]["tokens"],)) for name in SPLITS]
        fix = "lower data.seq_len, or keep more documents (data.max_docs, data.max_bytes, data.val_fraction)"
        fields = [("data.seq_len", fix), ("data.seq_len", fix)]
    else:
        meta = verify(entry, ("tokenizer.json",))
        splits = flat_streams(meta)
        held_out = "data.val_tokens" if cfg.val_tokens else "data.val_fraction"
        fields = [("data.tokens", "give more tokens, or lower data.seq_len"),
                  (held_out, f"hold out more tokens ({held_out}), or lower data.seq_len")]
    for name, tokens, (field, fix) in zip(SPLITS, splits, fields):
        if len(tokens) < cfg.seq_len + 1:
            raise StudyError(field, f"the {name} split has {len(tokens)} tokens, fewer than one window of "
                             f"seq_len + 1 = {cfg.seq_len + 1}", fix)
    return PreparedData(*splits, entry / "tokenizer.json", meta["vocab_size"], meta["eos_id"], cfg.seq_len, entry,
                        meta)


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
        if problem := shape_problem(state["splits"].get(name), {"documents": COUNT, "bytes": COUNT, "tokens": COUNT}):
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
    by_split: dict[str, list[str]] = {name: [] for name in SPLITS}
    for i, text in enumerate(texts, state["docs"]):
        by_split[p.target(i)].append(text)
    for name, docs in by_split.items():
        if not docs:
            continue
        encoded = encoder.encode_batch_fast(docs, add_special_tokens=False)
        eos = np.array([eos_id], dtype=dtype)
        flat = np.concatenate([piece for e in encoded for piece in (np.asarray(e.ids, dtype=dtype), eos)])
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
