"""The shard entry's on-disk format, shared by the writer (`prepare`) and the reader (`shards`)."""

from __future__ import annotations

import numpy as np

SHARD_FORMAT = 2
"""Version of the entry layout; an entry of another version is rebuilt, never misread."""
CHECKED = ("train.bin", "val.bin", "tokenizer.json")
"""Files whose SHA-256 the entry's meta.json records (what a run's data record compares)."""
SPLITS = ("train", "val")
"""The splits every entry holds, in this order."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
