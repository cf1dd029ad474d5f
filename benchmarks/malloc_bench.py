"""glibc malloc: the tiny training step under glibc's default allocator settings against settings that keep freed
memory in the process.

By default glibc returns large freed blocks to the kernel (blocks over M_MMAP_THRESHOLD are mmapped, the heap top
over M_TRIM_THRESHOLD is trimmed), so every step's activations fault their pages in again. The peer process sets
MALLOC_MMAP_THRESHOLD_=32 MiB and MALLOC_TRIM_THRESHOLD_=1 GiB in its environment (read at process start; a
running process can call mallopt). Each sample is a fresh child process timing the median of its steps after a
warm-up; children alternate between the two settings.

    python -m benchmarks.malloc_bench conventional 10 1     # child: KIND STEPS THREADS -> one JSON line
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import load_average, median, row
from benchmarks.step import TINY, conventional, describe, hourglass, our_step

KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
PROCESSES = 4
"""Child processes per setting."""
ROOT = Path(__file__).resolve().parent.parent


def child(kind: str, steps: int, threads: int) -> dict:
    """Median step seconds and minor page faults per step of one model in this process."""
    import torch

    torch.set_num_threads(threads)
    cfg = conventional(TINY) if kind == "conventional" else hourglass(TINY, int(kind.removeprefix("hourglass")))
    step, _ = our_step(cfg, TINY)
    for _ in range(2):
        step()
    seconds, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"step_s": median(seconds), "faults_per_step": faults / steps}


def _sample(kind: str, steps: int, threads: int, tuned: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED}
    if tuned:
        env.update(KEEP_FREED)
    done = subprocess.run([sys.executable, "-m", "benchmarks.malloc_bench", kind, str(steps), str(threads)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def run(quick: bool) -> list[dict]:
    import torch

    threads, steps = torch.get_num_threads(), 10 if quick else 16
    kinds = {"conventional": conventional(TINY)} if quick else {"conventional": conventional(TINY),
                                                                   "hourglass4": hourglass(TINY, 4)}
    settings = " ".join(f"{k}={v}" for k, v in KEEP_FREED.items())
    rows = []
    for kind, cfg in kinds.items():
        load = load_average()
        samples: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(PROCESSES):
            for tuned in (False, True) if r % 2 == 0 else (True, False):
                samples[tuned].append(_sample(kind, steps, threads, tuned))
        default, kept = (median([s["step_s"] for s in samples[t]]) for t in (False, True))
        rows.append(row(f"train step tokens/s, glibc malloc defaults vs {settings} ({describe(cfg)}, "
                        f"batch {TINY.micro_batch}x{TINY.seq_len}, {threads} threads)",
                        TINY.tokens / default, TINY.tokens / kept, "tokens/s", "higher",
                        faults_per_step=median([s["faults_per_step"] for s in samples[False]]),
                        peer_faults_per_step=median([s["faults_per_step"] for s in samples[True]]),
                        processes_per_setting=PROCESSES, steps_per_process=steps, load_avg=[load, load_average()]))
    return rows


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
