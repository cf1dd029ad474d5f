"""A local launch of tiny runs (two arms x ten seeds: 20 runs; `--quick`: two seeds, 4 runs), forked from the
launcher's warm server against every job started in a fresh interpreter (`cluster.warm_start=false`).

ours: `study launch` with warm starts (the default): one server imports torch and MLflow, each job is forked from it.
peer: the same launch with `cluster.warm_start=false`: submitit's local executor starts each job as `python -m
submitit.core._submit`, which imports them itself. Both in fresh folders with fresh stores, data already prepared (a
first launch fills the data cache before anything is timed). CPU seconds of every process the launch started (the
launcher, the server, submitit's controllers, the jobs), and wall seconds; the runs' results are checked equal.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import load_average, median, row

EXPERIMENT = """
description: tiny runs for the launch benchmark
baseline: conventional
scales: [tiny]
seeds: {seeds}
variants: {conventional: {model: conventional}, hourglass: {model: hourglass}}
common:
  model: {n_layers: 2, d_model: 64, n_heads: 2, ffn: {width: 128}, max_seq_len: 32, vocab_size: 512}
  data: {seq_len: 32, max_docs: 1500, vocab_size: 512, val_fraction: 0.05}
  train: {max_steps: 16, ckpt_interval: 8, val_interval: 8, micro_batch: 4, val_batches: 2, warmup_steps: 2, lr: 3.0e-3}
  eval: {after_train: false}
  budget: {tolerance: 1.0e-2}
"""


def _launch(sweeps: Path, warm: bool) -> tuple[float, float, list]:
    """CPU and wall seconds of one launch in a fresh folder, and its runs' final losses."""
    import shutil

    folder = Path(tempfile.mkdtemp(prefix="launch-bench-"))
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "STUDY_SWEEPS": str(sweeps)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "study.cli", "launch", "bench", "cluster=local",
                    f"cluster.warm_start={str(warm).lower()}"], cwd=folder, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    losses = sorted(json.loads(p.read_text())["val_loss"] for p in folder.glob("runs/bench/*/result.json"))
    shutil.rmtree(folder, ignore_errors=True)
    return cpu, wall, losses


def run(quick: bool) -> list[dict]:
    import shutil

    root = Path(__file__).resolve().parents[1]
    sweeps = Path(tempfile.mkdtemp(prefix="launch-bench-sweeps-")) / "sweeps"
    shutil.copytree(root / "sweeps", sweeps)
    seeds = 2 if quick else 10
    (sweeps / "experiment" / "bench.yaml").write_text(EXPERIMENT.replace("{seeds}", str(list(range(seeds)))))
    _launch(sweeps, warm=False)  # fills the data cache: neither side tokenises
    load = load_average()
    samples: dict[str, list[tuple[float, float]]] = {"ours": [], "peer": []}
    results = set()
    for i in range(2):
        for side in (("ours", "peer") if i % 2 == 0 else ("peer", "ours")):
            cpu, wall, losses = _launch(sweeps, warm=side == "ours")
            samples[side].append((cpu, wall))
            results.add(tuple(losses))
    if len(results) != 1 or len(next(iter(results))) != 2 * seeds:
        raise AssertionError(f"warm and cold launches trained different results: {results}")
    shutil.rmtree(sweeps.parent, ignore_errors=True)
    cpu = {side: median([c for c, _ in s]) for side, s in samples.items()}
    wall = {side: median([w for _, w in s]) for side, s in samples.items()}
    extra = dict(runs=2 * seeds, results_agree=True, load_avg=[load, load_average()])
    name = f"local launch of {2 * seeds} tiny runs"
    return [row(f"{name}, CPU seconds of every process: warm starts vs fresh interpreters",
                cpu["ours"], cpu["peer"], "s", "lower", **extra),
            row(f"{name}, wall seconds: warm starts vs fresh interpreters",
                wall["ours"], wall["peer"], "s", "lower", **extra)]
