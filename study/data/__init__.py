"""Data: corpora tokenised once into memory-mapped shards, and batches that are pure functions of the step.

    cfg = DataConfig(max_docs=2000, vocab_size=512, seq_len=64)
    data = prepare_data(cfg)             # builds (once) the docstring corpus, BPE and shards in the cache
    x, y = get_batch(data.train, data.seq_len, data_seed=0, step=0, micro_batch=8)
    for x, y in val_batches(data.val, data.seq_len, batch_size=8, num_batches=4): ...
"""

from study.data.batches import BatchStream, get_batch, loader_tokens_per_s, num_windows, val_batches, window_ids
from study.config.data import DataConfig, cache_root, validate_data
from study.data.sources import build_docstring_corpus
from study.data.shards import PreparedData, prepare_data
from study.data.tokenizer import load_tokenizer

__all__ = ["BatchStream", "DataConfig", "PreparedData", "build_docstring_corpus", "cache_root", "get_batch",
           "load_tokenizer", "loader_tokens_per_s", "num_windows", "prepare_data", "val_batches", "validate_data",
           "window_ids"]
