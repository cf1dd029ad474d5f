"""CPU threads: the tiny model's training step with torch's default intra-op threads against one thread, under the
load the machine has right now.

On an idle machine more threads win; on a shared one, OpenMP threads that wait at barriers for a descheduled peer
can make the default several times slower than one thread. The figure says which case this machine is in, and how
far a training process should trust its default thread count when it shares the cores (parallel local runs do).
"""

from __future__ import annotations

from benchmarks.common import default_threads, interleaved, load_average, median, row, spread
from benchmarks.step import TINY, conventional, describe, our_step


def run(quick: bool) -> list[dict]:
    import torch

    shape = TINY
    cfg = conventional(shape)
    step, _ = our_step(cfg, shape)
    harness = torch.get_num_threads()
    n = default_threads()

    def with_threads(count: int):
        def call() -> None:
            torch.set_num_threads(count)
            step()

        return call

    load = load_average()
    try:
        s = interleaved({"default": with_threads(n), "one": with_threads(1)}, 6 if quick else 16)
    finally:
        torch.set_num_threads(harness)
    return [row(f"train step tokens/s with torch's default {n} threads vs 1 thread under the current load "
                f"({describe(cfg)}, batch {shape.micro_batch}x{shape.seq_len})", shape.tokens / median(s["default"]),
                shape.tokens / median(s["one"]), "tokens/s", "higher", threads=n,
                spread=round(max(spread(v) for v in s.values()), 3), load_avg=[load, load_average()])]
