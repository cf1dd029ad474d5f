"""`study report` over a synthetic store of 125 runs with full curves, against a naive read of the same runs.

The store: `benchmarks.synthetic_store.synthetic_store`, 5 variants x 5 scales x 5 seeds, every run logging train/loss and
train/lr at every step, val/loss and val/ppl every steps/20, six eval/* scores (not timed).
ours: `analysis.report.build_report` end to end (one search_runs for the finals, val/loss histories for the curve
plot, paired statistics with 9999 bootstrap resamples, scaling fits, plots, markdown + HTML, logged to MLflow).
peer: only reading the data the naive way, one `get_metric_history` per run and metric key, no statistics and no
plots. Two rows: the report's own reads against it, and the whole report against it (ratio < 1: what the
statistics, plots and files cost in units of that read).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import interleaved, load_average, median, row

VARIANTS = ("conventional", "hourglass", "hourglass_attn", "olmo2", "tapered")
SCALES = ("113M", "256M", "440M", "906M", "1B")
SEEDS = 5


def run(quick: bool) -> list[dict]:
    from analysis.report import build_report
    from analysis.run_table import read_curves, read_runs
    from benchmarks.synthetic_store import synthetic_store
    from study.track.store import mlflow_client

    steps = 200 if quick else 1000
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        run_ids = synthetic_store(uri, "bench", VARIANTS, SCALES, SEEDS, steps)
        client = mlflow_client(uri)
        keys = sorted(client.get_run(run_ids[0]).data.metrics)

        def ours() -> None:
            build_report("bench", tracking_uri=uri, out_dir=Path(tmp) / "reports")

        points: list[int] = []

        def peer() -> None:
            points[:] = [len(client.get_metric_history(run_id, key)) for run_id in run_ids for key in keys]

        def ours_reads() -> None:
            read_curves(read_runs("bench", uri)["run_id"], "val/loss", uri)

        load = load_average()
        s = interleaved({"ours": ours, "peer": peer, "reads": ours_reads}, 2 if quick else 3, warmup=1)
    what = f"{len(run_ids)} synthetic runs, {steps} steps, {len(keys)} metric keys each, {sum(points)} points"
    common = {"runs": len(run_ids), "load_avg": [load, load_average()]}
    return [row(f"report's reads (one search_runs + val/loss histories) vs naive get_metric_history per run and key "
                f"({what})", median(s["reads"]), median(s["peer"]), "s", "lower", **common),
            row(f"study report end to end vs the naive read alone ({what})", median(s["ours"]), median(s["peer"]),
                "s", "lower", **common)]
