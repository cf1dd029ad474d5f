"""Where documents come from: a Hugging Face dataset (hub, `save_to_disk` directory, data files) or the embedded corpus.

All sources end as the same two `datasets.Dataset` objects (train, val), so everything after loading
runs one code path. `datasets` is imported lazily: planning commands import this package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from study.data.cache import cache_key, fingerprint_path
from study.config.data import EMBEDDED, DataConfig, cache_root, tokenize_procs
from study.data.corpus import build_docstring_corpus
from study.errors import StudyError

if TYPE_CHECKING:
    from datasets import Dataset

# The held-out documents are drawn with a fixed seed, independent of any run's data seed, so every
# run of a study validates on the same text.
VAL_SPLIT_SEED = 20240601
CAP_SCAN_ROWS = 10_000


@dataclass(frozen=True)
class Splits:
    train: Dataset
    val: Dataset
    val_from: str
    """Where the validation documents came from: the dataset's named split or `fraction`."""


def source_key(cfg: DataConfig) -> str:
    """Identity of the documents, known without loading them: name, config, split rule, caps, local file stats."""
    local = Path(cfg.name).expanduser()
    stats = fingerprint_path(local) if cfg.name != EMBEDDED and local.exists() else None
    return cache_key(cfg.name, cfg.config_name, cfg.text_field, cfg.train_split, cfg.val_split,
                     cfg.val_fraction, cfg.max_docs, cfg.max_bytes, stats)


def load_splits(cfg: DataConfig) -> Splits:
    """Train and validation documents, capped, with only the text column."""
    raw = _load(cfg)
    if cfg.train_split not in raw:
        raise StudyError("data.train_split", f"{cfg.name} has no split {cfg.train_split!r} (it has {sorted(raw)})",
                         f"use one of {sorted(raw)}")
    train = _text_only(raw[cfg.train_split], cfg)
    if cfg.val_split in raw and cfg.val_split != cfg.train_split:
        val = _cap(_text_only(raw[cfg.val_split], cfg), cfg, _share(cfg.max_docs, cfg.val_fraction),
                   _share(cfg.max_bytes, cfg.val_fraction))
        return Splits(_cap(train, cfg, cfg.max_docs, cfg.max_bytes), val, cfg.val_split)
    train = _cap(train, cfg, cfg.max_docs, cfg.max_bytes)
    if len(train) < 2:
        raise StudyError("data.max_docs", f"{len(train)} training document(s) cannot be split into train and "
                         "validation", "keep at least two documents")
    n_val = min(len(train) - 1, max(1, round(len(train) * cfg.val_fraction)))
    order = np.random.Generator(np.random.PCG64(VAL_SPLIT_SEED)).permutation(len(train))
    # Sorted indices keep the source's document order inside each split.
    return Splits(train.select(np.sort(order[n_val:])), train.select(np.sort(order[:n_val])), "fraction")


def _load(cfg: DataConfig) -> dict[str, Dataset]:
    import datasets

    local = Path(cfg.name).expanduser()
    if cfg.name == EMBEDDED:
        corpus = build_docstring_corpus(cache_root(cfg), cfg.max_docs, cfg.max_bytes)
        loaded = datasets.load_dataset("json", data_files={"train": str(corpus)},
                                       cache_dir=str(cache_root(cfg) / "hf"))
    elif local.is_dir() and any((local / f).exists() for f in ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(str(local))
    elif local.exists():
        loaded = datasets.load_dataset(str(local), cfg.config_name, cache_dir=str(cache_root(cfg) / "hf"))
    else:
        loaded = datasets.load_dataset(cfg.name, cfg.config_name, num_proc=tokenize_procs(cfg))
    if isinstance(loaded, datasets.Dataset):
        return {cfg.train_split: loaded}
    return dict(loaded)


def _share(cap: int | None, fraction: float) -> int | None:
    return None if cap is None else max(1, math.ceil(cap * fraction))


def _text_only(ds: Dataset, cfg: DataConfig) -> Dataset:
    if cfg.text_field not in ds.column_names:
        raise StudyError("data.text_field", f"{cfg.name} has no column {cfg.text_field!r} (it has {ds.column_names})",
                         f"use one of {ds.column_names}")
    return ds.select_columns([cfg.text_field])


def _cap(ds: Dataset, cfg: DataConfig, max_docs: int | None, max_bytes: int | None) -> Dataset:
    """The first documents of `ds` within the caps (reading only text lengths, in Arrow)."""
    n = len(ds) if max_docs is None else min(len(ds), max_docs)
    if max_bytes is not None:
        import pyarrow.compute as pc

        arrow = ds.with_format("arrow")
        total = 0
        for start in range(0, n, CAP_SCAN_ROWS):
            texts = arrow[start:min(n, start + CAP_SCAN_ROWS)].column(cfg.text_field)
            ends = total + np.cumsum(pc.fill_null(pc.binary_length(texts), 0).to_numpy())
            reached = int(np.searchsorted(ends, max_bytes))
            if reached < len(ends):
                n = start + reached + 1
                break
            total = int(ends[-1])
    return ds if n == len(ds) else ds.select(range(n))
