"""MLflow logging overhead per training step, into an SQLite store: `study.track.tracker.Tracker` against no tracking,
and against the straightforward synchronous `log_metric` per point.

Each sample is a block of steps of the tiny model, each step logging train/loss, train/lr, train/grad_norm and
train/tokens_per_s. The Tracker's block ends with `flush()` inside the timed region, so the background thread's
`log_batch` of the block's points is charged to the block (an upper bound: in training it overlaps the steps).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import interleaved, load_average, median, row, spread
from benchmarks.step import TINY, conventional, describe, our_step

METRICS = ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s")


def run(quick: bool) -> list[dict]:
    from study.track.store import get_or_create_experiment, mlflow_client
    from study.track.tracker import Tracker, TrackingConfig

    shape = TINY
    block, rounds = (10, 4) if quick else (20, 8)
    cfg = conventional(shape)
    step, _ = our_step(cfg, shape)
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        tracker = Tracker.open("bench", "benchmarks", "tracked", cfg=TrackingConfig(uri=uri))
        client = mlflow_client(uri)
        naive_run = client.create_run(get_or_create_experiment(client, uri, "benchmarks"), run_name="naive").info.run_id
        counter = {"tracker": 0, "naive": 0}

        def untracked() -> None:
            for _ in range(block):
                step()

        def tracked() -> None:
            for _ in range(block):
                step()
                counter["tracker"] += 1
                tracker.log_metrics({k: 1.0 / counter["tracker"] for k in METRICS}, counter["tracker"])
            tracker.flush()

        def naive() -> None:
            for _ in range(block):
                step()
                counter["naive"] += 1
                for k in METRICS:
                    client.log_metric(naive_run, k, 1.0 / counter["naive"], step=counter["naive"])

        load = load_average()
        try:
            s = interleaved({"untracked": untracked, "tracker": tracked, "naive": naive}, rounds, warmup=1)
        finally:
            tracker.close()
        client.set_terminated(naive_run)
    per_step = {name: median(v) / block for name, v in s.items()}
    share = {name: per_step[name] / per_step["untracked"] - 1 for name in ("tracker", "naive")}
    common = {"steps_per_sample": block, "rounds": rounds, "spread": round(max(spread(v) for v in s.values()), 3),
              "load_avg": [load, load_average()]}
    what = f"{len(METRICS)} metrics per step, SQLite store, {describe(cfg)} step"
    return [
        row(f"step time with Tracker logging vs untracked ({what})", per_step["tracker"], per_step["untracked"],
            "s/step", "lower", overhead_share=share["tracker"], **common),
        row(f"step time with Tracker logging vs synchronous log_metric per point ({what})", per_step["tracker"],
            per_step["naive"], "s/step", "lower", overhead_share=share["tracker"],
            naive_overhead_share=share["naive"], **common),
    ]
