"""The tokenizer: a byte-level BPE trained on the corpus, or a given tokenizer.json / transformers directory, always
resolved to one `tokenizer.json` that tokenisation, checkpoints and evaluation all read."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from study.data.cache import build_once, file_digest
from study.config.data import EOS_CANDIDATES, TRAIN_BPE, DataConfig
from study.errors import StudyError
from study.files import damaged, read_mapping

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS = "<|endoftext|>"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class TokenizerFile:
    path: Path
    """The tokenizer.json every job of the runs loads."""
    eos_id: int
    """Id of the token placed between documents."""
    vocab_size: int
    """One more than the largest id the tokenizer can emit, added tokens included: the rows an embedding needs."""
    key: str
    """Content hash of the tokenizer file and EOS choice: part of the token shards' cache key."""


def resolve_tokenizer(cfg: DataConfig, cache: Path, source_key: str,
                      train_docs: Callable[[], Iterator[list[str]]], build: bool = True) -> TokenizerFile | None:
    """The tokenizer.json for `cfg`, training the BPE once per (corpus, vocab size) on `train_docs()` when
    tokenizer=bpe. With `build=False` nothing is trained or converted: None when it does not exist yet."""
    given = Path(cfg.tokenizer).expanduser()
    if cfg.tokenizer == TRAIN_BPE:
        entry = cache / "tokenizers" / f"bpe{cfg.vocab_size}-{source_key}"
        if not build and not entry.is_dir():
            return None
        path = build_once(entry, lambda tmp: train_bpe(train_docs(), cfg.vocab_size)
                          .save(str(tmp / "tokenizer.json"))) / "tokenizer.json"
        declared = EOS
    elif given.is_file():
        path, declared = given, declared_eos(given.parent)
    elif (given / "tokenizer.json").is_file():
        path, declared = given / "tokenizer.json", declared_eos(given)
    elif not given.is_dir():
        if build:
            raise StudyError("data.tokenizer", f"no tokenizer file or directory at {cfg.tokenizer}",
                             f"use `{TRAIN_BPE}` to train one on the corpus, or give a tokenizer.json or a "
                             "transformers tokenizer directory")
        return None
    else:
        entry = cache / "tokenizers" / f"hf-{file_digest(sorted(p for p in given.iterdir() if p.is_file()))}"
        if not build and not entry.is_dir():
            return None
        path, declared = _convert_transformers(given, entry), declared_eos(given)
    tok = load_tokenizer(path)
    eos = eos_id(tok, cfg.eos_token or declared)
    return TokenizerFile(path, eos, id_bound(tok), f"{file_digest([path])}-{eos}")


def id_bound(tok: Tokenizer) -> int:
    """One more than the largest id `tok` emits (`get_vocab_size` counts entries, fewer where ids have gaps)."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def train_bpe(batches: Iterator[list[str]], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation) with `<|endoftext|>` as id 0, trained on a stream of text batches."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(batches, trainer)
    return tok


def load_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise StudyError("data.tokenizer", f"{path} is not a tokenizers file ({err})",
                         "give a tokenizer.json written by `tokenizers` or a transformers tokenizer directory") from err


def eos_id(tok: Tokenizer, wanted: str | None, field: str = "data.eos_token") -> int:
    """Id of the token that ends a document: `wanted`, else the first of EOS_CANDIDATES in the vocabulary."""
    for token in (wanted,) if wanted else EOS_CANDIDATES:
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    missing = f"no token {wanted!r}" if wanted else f"none of the end-of-sequence tokens {list(EOS_CANDIDATES)}"
    raise StudyError(field, f"the tokenizer has {missing}",
                     f"set {field} to the token that ends a document in this tokenizer's vocabulary")


def declared_eos(directory: Path) -> str | None:
    """The EOS a directory's tokenizer_config.json declares (a transformers tokenizer's, or a run directory's)."""
    config = directory / TOKENIZER_CONFIG
    if not config.exists():
        return None
    fix = (f"repair or delete {config} (a run directory's is written again at the run's next start; without it a "
           "tokenizer directory declares no end-of-document token: set data.eos_token)")
    eos = read_mapping(config, {}, fix).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos is not None and not isinstance(eos, str):
        raise damaged(config, f"declares the end-of-document token {json.dumps(eos)[:60]}, not a token's text", fix)
    return eos


def _convert_transformers(directory: Path, entry: Path) -> Path:
    """A fast transformers tokenizer saved from files such as vocab.json + merges.txt, as one tokenizer.json."""

    def convert(tmp: Path) -> None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as err:
            raise StudyError("data.tokenizer", f"{directory} is not a transformers tokenizer directory ({err})",
                             "give a tokenizer.json or a directory written by `save_pretrained`") from err
        if not tok.is_fast:
            raise StudyError("data.tokenizer", f"{directory} holds a slow (Python) tokenizer",
                             "save it as a fast tokenizer (tokenizer.json) with transformers first")
        tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))

    return build_once(entry, convert) / "tokenizer.json"
