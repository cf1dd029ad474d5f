"""Pre-tokenised flat token files (OLMo-style `.npy`/`.bin`): listed, scanned once, and read in place.

A file is one array of ids: raw little-endian ids from byte 0 (`.bin`, and most OLMo `.npy` files), or a real NumPy
file when it starts with the magic `\\x93NUMPY`. The files join end to end into one :class:`TokenStream` of memory maps:
nothing is copied. The scan (:func:`write_flat`, once per cache entry) refuses any id the tokenizer cannot emit and
records each file's layout and content digest in meta.json. Validation reads `data.val_tokens`, else holds out
`data.val_fraction` of the stream in VAL_BLOCK-token blocks, one drawn (fixed seed) from each of as many equal strata:
every source of a mix is validated in proportion, the same blocks for every run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from study.config.identity import json_digest
from study.config.data import VAL_BLOCK, VAL_SPLIT_SEED, DataConfig, tokenize_procs
from study.data.cache import cache_key, fingerprint_path, sha256_file
from study.data.tokenizer import TokenizerFile
from study.errors import StudyError
from study.files import COUNT, TEXT, damaged, read_mapping, replace_file, shape_problem

FLAT_FORMAT = 1
NPY_MAGIC = b"\x93NUMPY"
SUFFIXES = (".npy", ".bin")
SCAN_CHUNK = 1 << 24
"""Ids read at a time while looking for the largest (64 MiB of uint32)."""
SAMPLE = 1 << 20
"""Bytes at each end of a file that its content digest hashes."""
SPOT_BLOCKS, SPOT_BLOCK = 16, 1 << 16
"""A resume's check of a file's bytes (:func:`spot_digest`): 16 blocks of 64 KiB, a file of at most 1 MiB whole."""
OPEN_MAPS = 64
"""Memory maps a stream keeps open: a release of thousands of files would otherwise hold as many descriptors."""
SCANNED = "scanned.json"


def flat_key(cfg: DataConfig) -> str:
    """Identity of the token stream without reading it: the listed paths' file names, sizes and mtimes, the id type
    and the held-out rule."""
    rule: Any = ["val_tokens", _stats(cfg.val_tokens)] if cfg.val_tokens else ["fraction", cfg.val_fraction, VAL_BLOCK]
    return cache_key("flat", FLAT_FORMAT, _stats(cfg.tokens), cfg.token_dtype, rule)


def _stats(entries: list[str] | None) -> list[tuple[str, str]]:
    paths = [Path(e).expanduser() for e in entries or []]
    return [(str(p.resolve()), fingerprint_path(p)) for p in paths]


def list_token_files(entries: list[str], field: str) -> list[Path]:
    """The files of `entries` in reading order, each directory's non-hidden `.npy`/`.bin` files in natural order."""
    files: list[Path] = []
    for entry in entries:
        path = Path(entry).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = [p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()
                     and not any(part.startswith(".") for part in p.relative_to(path).parts)]
            if not found:
                raise StudyError(field, f"{entry} holds no .npy or .bin files",
                                 "name a directory of flat token files, or the files themselves")
            # `part-2` before `part-10`: runs of digits compare as numbers (at odd positions of the split, never text)
            files += sorted(found, key=lambda p: [int(t) if i % 2 else t for i, t in enumerate(
                re.split(r"(\d+)", p.relative_to(path).as_posix()))])
        else:
            raise StudyError(field, f"no token file or directory at {entry}",
                             "give existing .npy/.bin files or directories holding them (nothing is downloaded)")
    return files


@dataclass(frozen=True)
class FlatFile:
    """Where the ids of one flat token file lie."""

    path: str
    """The file."""
    offset: int
    """Bytes before the first id: a `.npy` header's length, else 0."""
    tokens: int
    """Ids in the file."""

    def open(self, dtype: np.dtype) -> np.memmap:
        """The file's ids, memory-mapped read-only."""
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.offset, shape=(self.tokens,))


def read_layout(path: Path, dtype: np.dtype, field: str) -> FlatFile:
    """The layout of one file of ids of `dtype`: raw, or a C-ordered `.npy` of that dtype (flattened)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        # raw ids would have to begin with uint32 1297436307 (or uint16 20115, 19797, 22864) to look like a header
        headed = f.read(len(NPY_MAGIC)) == NPY_MAGIC
    if headed:
        try:
            array = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as err:
            raise StudyError(field, f"{path} starts like a .npy file but cannot be read as one ({err})",
                             "download the file again") from None
        if array.dtype != dtype:
            raise StudyError("data.token_dtype", f"{path} declares ids of type {array.dtype.str} ({array.dtype.name})"
                             f", not {dtype.name}", f"set data.token_dtype={array.dtype.name} if every file holds "
                             "such ids (little-endian uint16 or uint32), or convert the file")
        if array.ndim > 1 and not array.flags.c_contiguous:
            raise StudyError(field, f"{path} is a Fortran-ordered .npy array", "save the ids in C order")
        layout = FlatFile(str(path), int(array.offset), int(array.size))
        if layout.offset + layout.tokens * dtype.itemsize != size:
            raise StudyError(field, f"{path} holds {size - layout.offset} bytes of ids where its header declares "
                             f"{layout.tokens} ids of {dtype.itemsize} bytes", "download the file again")
    else:
        if size % dtype.itemsize:
            raise StudyError(field, f"{path} has {size} bytes, not a whole number of {dtype.name} ids",
                             f"check data.token_dtype (now {dtype.name}), or download the truncated file again")
        layout = FlatFile(str(path), 0, size // dtype.itemsize)
    if layout.tokens == 0:
        raise StudyError(field, f"{path} holds no tokens", "remove it, or download it again")
    return layout


def content_digest(path: Path, blocks: int = 2, length: int = SAMPLE) -> str:
    """SHA-256 of the file's size and `blocks` (>= 2) evenly spaced blocks of `length` bytes, first and last at the
    ends (the whole file when at most blocks x length bytes). By default its first and last MiB: names a release's
    file wherever it lives (paths and mtimes would not), without hours of hashing terabytes."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= blocks * length:
            h.update(f.read())
        else:
            for i in range(blocks):
                f.seek(i * (size - length) // (blocks - 1))
                h.update(f.read(length))
    return h.hexdigest()


def spot_digest(path: Path) -> str:
    """:func:`content_digest` of SPOT_BLOCKS blocks of SPOT_BLOCK bytes (the whole file when at most 1 MiB): what a
    resume compares with the digests recorded at the run's start (study.train.loop.check_data), so a rewrite that kept
    size and mtime is caught. Kept per process until the file's size, mtime or ctime moves."""
    stat = path.stat()
    return _spot(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@functools.cache
def _spot(path: str, size: int, mtime_ns: int, ctime_ns: int) -> str:
    return content_digest(Path(path), SPOT_BLOCKS, SPOT_BLOCK)


def spot_digests(paths: list[str], workers: int) -> dict[str, str]:
    """:func:`spot_digest` of each file, `workers` at a time (the reads wait on the file system, not the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="spot") as pool:
        return dict(zip(paths, pool.map(lambda p: spot_digest(Path(p)), paths)))


def scan_file(layout: FlatFile, dtype: np.dtype) -> dict[str, Any]:
    """One file's layout, largest id and content digest."""
    ids = layout.open(dtype)
    largest = max(int(ids[i:i + SCAN_CHUNK].max()) for i in range(0, layout.tokens, SCAN_CHUNK))
    del ids  # the map (and its descriptor) closes before the next file is scanned
    return {"path": layout.path, "offset": layout.offset, "tokens": layout.tokens, "largest_id": largest,
            "digest": content_digest(Path(layout.path))}


def held_out_blocks(n_tokens: int, fraction: float) -> np.ndarray:
    """Sorted indices of the VAL_BLOCK-token blocks of an `n_tokens` stream held out for validation: one block drawn
    (fixed seed) from each of round(fraction * blocks) equal strata of blocks."""
    n_blocks = -(-n_tokens // VAL_BLOCK)
    if n_blocks < 2:
        raise StudyError("data.tokens", f"{n_tokens} tokens are fewer than the two blocks of {VAL_BLOCK} tokens that "
                         "holding out data.val_fraction of them needs", "give a validation set in data.val_tokens, or "
                         f"more than {VAL_BLOCK} tokens")
    n_val = min(n_blocks - 1, max(1, round(n_blocks * fraction)))
    edges = np.arange(n_val + 1, dtype=np.int64) * n_blocks // n_val
    return np.random.Generator(np.random.PCG64(VAL_SPLIT_SEED)).integers(edges[:-1], edges[1:])


class TokenStream:
    """Flat token files end to end, read in place and indexed like a token array (`len()`, ints, slices, integer
    arrays), each read a copy of just those ids. With `held` (sorted block indices) it shows only those
    VAL_BLOCK-token blocks (`keep_held`: the validation split) or every other block (training)."""

    def __init__(self, files: list[FlatFile], dtype: np.dtype, held: np.ndarray | None = None,
                 keep_held: bool = False):
        self.files, self.dtype = files, np.dtype(dtype)
        self.starts = np.cumsum([0] + [f.tokens for f in files], dtype=np.int64)
        self.held, self.keep_held = held, keep_held
        total = int(self.starts[-1])
        if held is None:
            self.size = total
        else:
            held_tokens = int(np.minimum(VAL_BLOCK, total - held * VAL_BLOCK).sum())
            self.size = held_tokens if keep_held else total - held_tokens
            # kept block b is the stream's block b + (the held blocks j with held[j] - j <= b, i.e. before it)
            self._kept_before = held - np.arange(len(held))
        self._map = functools.lru_cache(maxsize=OPEN_MAPS)(lambda i: self.files[i].open(self.dtype))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            index = np.arange(*key.indices(self.size), dtype=np.int64)
        else:
            index = np.asarray(key)
            if index.dtype.kind not in "iu":
                raise TypeError(f"a token stream is indexed by integers or slices, not {index.dtype}")
            index = index.astype(np.int64)
        if index.size and (index.min() < -self.size or index.max() >= self.size):
            raise IndexError(f"index out of range for a token stream of {self.size} tokens")
        at = self._stream_index(np.where(index < 0, index + self.size, index).ravel())
        piece = np.searchsorted(self.starts, at, side="right") - 1
        out = np.empty(at.shape, self.dtype)
        for p in np.unique(piece):
            here = piece == p
            out[here] = self._map(int(p))[at[here] - self.starts[p]]
        return out.reshape(index.shape)[()]  # a 0-d result (an int key) comes back as a scalar

    def _stream_index(self, index: np.ndarray) -> np.ndarray:
        """Positions in the files laid end to end of positions in this (possibly block-selected) stream."""
        if self.held is None:
            return index
        block, within = np.divmod(index, VAL_BLOCK)
        if self.keep_held:
            block = self.held[block]
        else:
            block = block + np.searchsorted(self._kept_before, block, side="right")
        return block * VAL_BLOCK + within

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """Every id as one array: for small streams and tests. It is always a copy, so `copy=False` is refused."""
        if copy is False:
            raise ValueError("a token stream is read from its files: an array of it is always a copy")
        return self[:] if dtype is None else self[:].astype(dtype)


def write_flat(out: Path, cfg: DataConfig, tok: TokenizerFile, progress: bool = False,
               after_file: Callable[[int], None] | None = None) -> None:
    """Scan the token files of `cfg` into the build directory `out`: meta.json and a copy of the tokenizer. Each file
    is recorded in `scanned.json` as it finishes, so a killed scan resumes; `after_file(n)` runs after the n-th."""
    dtype = np.dtype(cfg.token_dtype)
    lists = {"tokens": list_token_files(cfg.tokens or [], "data.tokens")}
    if cfg.val_tokens:
        lists["val_tokens"] = list_token_files(cfg.val_tokens, "data.val_tokens")
    layouts = {str(p): read_layout(p, dtype, f"data.{field}") for field, files in lists.items() for p in files}
    record = out / SCANNED
    scanned = _read_scanned(record, out) if record.exists() else {}
    start = time.perf_counter()
    _scan_missing(layouts, scanned, dtype, record, tokenize_procs(cfg), progress, cfg.name, after_file)
    files = {field: [scanned[str(p)] for p in paths] for field, paths in lists.items()}
    for field, records in files.items():  # every id is one the tokenizer emits (and the model: check_model_vocab)
        for f in records:
            if f["largest_id"] >= tok.vocab_size:
                raise StudyError(f"data.{field}", f"{f['path']} holds token id {f['largest_id']}, beyond the "
                                 f"{tok.vocab_size} ids of the tokenizer {tok.path} (and of any model that embeds "
                                 "it)", "give the tokenizer the files were made with (data.tokenizer) and the id type "
                                 "they were written in (data.token_dtype: uint16 ids read as uint32 are huge)")
    shutil.copyfile(tok.path, out / "tokenizer.json")
    rule: dict[str, Any] = {"val_from": "val_tokens"} if cfg.val_tokens else {
        "val_from": "fraction", "val_fraction": cfg.val_fraction, "val_block": VAL_BLOCK, "val_seed": VAL_SPLIT_SEED}
    train, val = _streams(files, dtype, cfg.val_fraction)
    digests = {field: [f["digest"] for f in records] for field, records in files.items()}
    meta = {
        "format": FLAT_FORMAT, "kind": "flat", "dtype": dtype.name, "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id, "source": {"name": cfg.name, "tokens": cfg.tokens, "val_tokens": cfg.val_tokens, **rule},
        "tokenizer": str(tok.path), "files": files,
        "largest_id": max(f["largest_id"] for records in files.values() for f in records),
        "splits": {"train": {"tokens": len(train)}, "val": {"tokens": len(val)}},
        "scan_seconds": round(time.perf_counter() - start, 3),
        # what MLflow's dataset digest is made of (study.track.lineage): the tokenizer file's SHA-256, and per split
        # the SHA-256 of its files' content digests (see content_digest) with the rule that cut it
        "sha256": {"tokenizer.json": sha256_file(out / "tokenizer.json"),
                   **{split: json_digest([split, dtype.name, digests, rule], 64) for split in ("train", "val")}},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    record.unlink(missing_ok=True)


def _read_scanned(record: Path, out: Path) -> dict[str, Any]:
    """An interrupted scan's record of the files it finished, refused by name when damaged."""
    fix = f"delete {out}: the next `study prepare` (or launch) scans the token files from the start"
    scanned = read_mapping(record, {}, fix)
    fields = {"path": TEXT, "offset": COUNT, "tokens": COUNT, "largest_id": COUNT, "digest": TEXT}
    for path, entry in scanned.items():
        if problem := shape_problem(entry, fields):
            raise damaged(record, f"its entry for {path} {problem}", fix)
    return scanned


def _scan_missing(layouts: dict[str, FlatFile], scanned: dict[str, Any], dtype: np.dtype, record: Path,
                  workers: int, progress: bool, name: str, after_file: Callable[[int], None] | None) -> None:
    """Scan the files not in `scanned` yet, `workers` at a time, recording each atomically as it finishes."""
    from tqdm import tqdm

    todo = [layout for path, layout in layouts.items() if path not in scanned]
    bar = tqdm(total=sum(f.tokens for f in todo) * dtype.itemsize, unit="B", unit_scale=True, file=sys.stderr,
               desc=f"scanning {name}", disable=not progress, mininterval=1.0, dynamic_ncols=True)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scan")
    try:
        for future in as_completed([pool.submit(scan_file, f, dtype) for f in todo]):
            result = future.result()
            scanned[result["path"]] = result
            replace_file(record, json.dumps(scanned))  # the record only ever names finished scans
            bar.update(result["tokens"] * dtype.itemsize)
            if after_file:
                after_file(len(scanned))
    finally:
        pool.shutdown(cancel_futures=True)
        bar.close()


def flat_streams(meta: dict[str, Any]) -> tuple[TokenStream, TokenStream]:
    """The training and validation streams of a scanned entry's meta.json."""
    return _streams(meta["files"], np.dtype(meta["dtype"]), meta["source"].get("val_fraction"))


def _streams(records: dict[str, list[dict[str, Any]]], dtype: np.dtype,
             val_fraction: float | None) -> tuple[TokenStream, TokenStream]:
    """Training and validation streams: `val_tokens` when scanned, else `tokens` split by its held-out blocks."""
    files = {field: [FlatFile(f["path"], f["offset"], f["tokens"]) for f in found] for field, found in records.items()}
    if "val_tokens" in files:
        return TokenStream(files["tokens"], dtype), TokenStream(files["val_tokens"], dtype)
    held = held_out_blocks(sum(f.tokens for f in files["tokens"]), val_fraction)
    return TokenStream(files["tokens"], dtype, held), TokenStream(files["tokens"], dtype, held, keep_held=True)
