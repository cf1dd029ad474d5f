"""Data loading: tokens/s the batch stream delivers against tokens/s the tiny model's training step consumes.

ours: `study.data.loader_tokens_per_s` (BatchStream with a consumer that does no work: its ceiling) over a
memory-mapped uint16 shard, as prepare_data writes them. peer: the tiny conventional model's step on the same
batch shape. ratio = the loader's headroom (> 1: it never starves the step). Also reported: the step fed live by a
BatchStream, whose thread competes for the same cores.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import interleaved, load_average, median, row
from benchmarks.step import TINY, conventional, describe, our_step

SHARD_TOKENS = 4_000_000


def run(quick: bool) -> list[dict]:
    import numpy as np

    from study.data import BatchStream, loader_tokens_per_s

    shape = TINY
    rounds = 6 if quick else 16
    with tempfile.TemporaryDirectory(prefix="bench-shard-") as tmp:
        tokens = np.memmap(Path(tmp) / "train.bin", dtype=np.uint16, mode="w+", shape=(SHARD_TOKENS,))
        tokens[:] = np.random.default_rng(0).integers(0, shape.vocab_size, SHARD_TOKENS, dtype=np.uint16)
        tokens.flush()
        tokens = np.memmap(Path(tmp) / "train.bin", dtype=np.uint16, mode="r")
        cfg = conventional(shape)
        step, _ = our_step(cfg, shape)
        stream = BatchStream(tokens, shape.seq_len, data_seed=0, micro_batch=shape.micro_batch)
        fed_step, _ = our_step(cfg, shape)
        delivered: list[float] = []

        def loader() -> None:
            delivered.append(loader_tokens_per_s(tokens, shape.seq_len, shape.micro_batch, steps=200))

        load = load_average()
        with stream:
            s = interleaved({"loader": loader, "step": step, "fed": lambda: fed_step(next(stream)[0])}, rounds)
    return [row(f"batch stream tokens/s delivered vs the training step's consumption ({describe(cfg)}, "
                f"batch {shape.micro_batch}x{shape.seq_len}, memmap uint16 shard)",
                median(delivered[-rounds:]), shape.tokens / median(s["step"]), "tokens/s", "higher",
                step_fed_by_stream_tokens_per_s=shape.tokens / median(s["fed"]), rounds=rounds,
                load_avg=[load, load_average()])]
