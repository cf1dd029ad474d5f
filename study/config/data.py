"""Typed data configuration: which corpus, which tokenizer, how it is split and windowed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from study.errors import StudyError

EMBEDDED = "docstrings"
TRAIN_BPE = "bpe"
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
TOKEN_DTYPES = ("uint16", "uint32")
VAL_SPLIT_SEED = 20240601
"""Seed of the held-out documents (or token blocks), not any run's: every run of a study validates on the same text."""
VAL_BLOCK = 2**16
"""Tokens per block of a flat token stream that is held out (or kept) whole."""


@dataclass
class DataConfig:
    name: str = EMBEDDED
    """`docstrings` (the Python standard library's, built offline) or a Hugging Face dataset (a hub path, a
    `save_to_disk` directory or a directory of json/parquet files); with `tokens`, the token corpus's label."""
    config_name: str | None = None
    """Dataset configuration, e.g. `sample-10BT` for `HuggingFaceFW/fineweb-edu`; None for datasets with one."""
    text_field: str = "text"
    """Column that holds each document's text."""
    train_split: str = "train"
    """Split the training tokens come from."""
    val_split: str = "validation"
    """Split validated on when the dataset has it; otherwise val_fraction of the training documents is held out."""
    val_fraction: float = 0.01
    """Fraction held out for validation (0 < f < 1): of the documents without a `val_split`, of the token stream (in
    blocks of VAL_BLOCK tokens) for `tokens` without `val_tokens`."""
    tokenizer: str = TRAIN_BPE
    """`bpe` trains a byte-level BPE on the training documents; else a tokenizer.json or transformers tokenizer dir
    (with `tokens`, the one the files were made with)."""
    vocab_size: int = 4096
    """Vocabulary size of the trained BPE, `<|endoftext|>` included (only for tokenizer=bpe)."""
    eos_token: str | None = None
    """Token placed between documents; None finds `<|endoftext|>`, `</s>` or a similar one in the vocabulary."""
    seq_len: int = 128
    """Tokens per training sequence; each window holds seq_len + 1 tokens so targets are inputs shifted by one."""
    max_docs: int | None = None
    """Keep the first this many documents of the training split, held-out ones included (None keeps all)."""
    max_bytes: int | None = None
    """Keep training documents until their UTF-8 text reaches this many bytes (None keeps all); scaled like max_docs."""
    cache_dir: str | None = None
    """Where corpora, tokenizers and token shards are cached; None means $STUDY_CACHE, else ~/.cache/study."""
    num_proc: int | None = None
    """Threads that encode a chunk (or scan flat token files); None uses every core this process may run on."""
    tokens: list[str] | None = None
    """Pre-tokenised flat token files instead of documents: `.npy`/`.bin` files or directories of them, in the order
    given (a directory's files in natural order, `part-2` before `part-10`)."""
    val_tokens: list[str] | None = None
    """Flat token files validated on, read like `tokens`; None holds out `val_fraction` of the `tokens` stream."""
    token_dtype: str = "uint32"
    """Id type of the flat token files: `uint32` (OLMo's dolma2 files) or `uint16`; a `.npy` header must agree."""
    chunk_docs: int = 10_000
    """Documents tokenised between progress records (a killed `study prepare` resumes after the last one)."""


def cache_root(cfg: DataConfig) -> Path:
    """The cache directory every run of a sweep shares."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else study_cache()


def study_cache() -> Path:
    """study's own cache directory: $STUDY_CACHE, else ~/.cache/study."""
    return Path(os.environ.get("STUDY_CACHE") or Path.home() / ".cache" / "study").expanduser()


def tokenize_procs(cfg: DataConfig) -> int:
    return cfg.num_proc or len(os.sched_getaffinity(0))


def validate_data(cfg: DataConfig, files: bool = True) -> None:
    """Reject a bad data config before anything is tokenised or submitted; `files` also checks that local datasets,
    token files and tokenizers exist (where the data is read, not where a cluster run is planned)."""
    if cfg.tokens is not None:
        _validate_flat(cfg, files)
    elif cfg.val_tokens is not None:
        raise StudyError("data.val_tokens", "validation token files are given without training ones (data.tokens)",
                         "give the training token files in data.tokens, or drop data.val_tokens")
    elif not cfg.name:
        raise StudyError("data.name", "no dataset given", f"use `{EMBEDDED}` or a Hugging Face dataset path")
    elif files and cfg.name.startswith(("/", "./", "../", "~")) and not Path(cfg.name).expanduser().exists():
        raise StudyError("data.name", f"no dataset at {cfg.name}",
                         f"give an existing directory, a hub dataset path, or `{EMBEDDED}`")
    if not cfg.text_field:
        raise StudyError("data.text_field", "no text column given", "name the column holding the text, e.g. `text`")
    if cfg.seq_len <= 0:
        raise StudyError("data.seq_len", f"must be positive, got {cfg.seq_len}", "use a value > 0, e.g. 128")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise StudyError("data.val_fraction", f"must lie strictly between 0 and 1, got {cfg.val_fraction}",
                         "use e.g. 0.01")
    for name in ("max_docs", "max_bytes", "num_proc", "chunk_docs"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise StudyError(f"data.{name}", f"must be positive, got {value}", "use a value > 0, or null for no limit")
    if cfg.token_dtype not in TOKEN_DTYPES:
        raise StudyError("data.token_dtype", f"unknown token id type {cfg.token_dtype!r}",
                         f"use one of {', '.join(TOKEN_DTYPES)} (OLMo's dolma2 files are uint32)")
    if cfg.tokenizer == TRAIN_BPE:
        if not 257 <= cfg.vocab_size < 2**32:
            raise StudyError("data.vocab_size", "a byte-level BPE needs 256 byte tokens plus EOS, "
                             f"got {cfg.vocab_size}", "use a value >= 257, e.g. 4096")
    elif files and not Path(cfg.tokenizer).expanduser().exists():
        raise StudyError("data.tokenizer", f"no tokenizer file or directory at {cfg.tokenizer}",
                         f"use `{TRAIN_BPE}` to train one on the corpus, or give a tokenizer.json or a transformers "
                         "tokenizer directory")


def _validate_flat(cfg: DataConfig, files: bool) -> None:
    """The settings that read pre-tokenised files: a label, the tokenizer that made them, no document caps."""
    if cfg.name == EMBEDDED or not cfg.name:
        raise StudyError("data.name", f"{cfg.name or 'nothing'!r} would label the token files of data.tokens",
                         "name the token corpus, e.g. data.name=olmo2-mix (it names the cache entry and the MLflow "
                         "dataset)")
    if cfg.tokenizer == TRAIN_BPE:
        raise StudyError("data.tokenizer", "a BPE cannot be trained on token files, and evaluation and export need "
                         "the tokenizer that made them", "give that tokenizer's tokenizer.json or transformers "
                         "directory, e.g. OLMo-2's dolma2 tokenizer")
    for name in ("max_docs", "max_bytes"):
        if getattr(cfg, name) is not None:
            raise StudyError(f"data.{name}", "token files are not read as documents, so documents cannot be capped",
                             f"drop data.{name} (training reads only the windows its steps need)")
    for name in ("tokens", "val_tokens"):
        entries = getattr(cfg, name)
        if entries is None:
            continue
        if not entries:
            raise StudyError(f"data.{name}", "is an empty list", "list token files or directories, or set it to null")
        if missing := [e for e in entries if files and not Path(e).expanduser().exists()]:
            raise StudyError(f"data.{name}", f"no token file or directory at {missing[0]}",
                             "give existing .npy/.bin files or directories holding them (nothing is downloaded)")
