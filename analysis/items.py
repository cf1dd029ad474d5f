"""Downstream-task deltas with item-level uncertainty: a two-level bootstrap over seeds, then items. A task score is
a mean over a fixed set of items, so its noise comes from the seeds trained and from the items the benchmark holds.
Paired runs scored the same items (each run's evaluation of record, the ``items.jsonl`` of the evaluation its
``study.eval.<task>`` tag names), so the per-(seed, item) difference is the unit; one draw resamples the seeds and,
independently, the items (the same for every seed). Descriptive: the verdicts come from the paired t test.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.paired import TAILS
from analysis.records import JsonRecord, read_artifact
from study.schema import ITEMS_ARTIFACT, TAG_EVAL, eval_artifact

ITEM_METRICS = ("acc", "acc_norm", "ll_correct")
"""Per-item scores compared: accuracy, length-normalised accuracy, log-likelihood of the correct choice."""


@dataclass(frozen=True)
class ItemDelta(JsonRecord):
    """Variant minus baseline on one task's per-item score at one scale."""

    task: str
    """lm-eval task name."""
    metric: str
    """Per-item score (acc, acc_norm or ll_correct)."""
    scale: str
    variant: str
    baseline: str
    n_seeds: int
    """Seed pairs with items on both sides."""
    n_items: int
    """Items scored on both sides of every pair."""
    chance: float
    """A random guess's accuracy on those items (mean of 1 / choices); NaN for ll_correct or unknown choices."""
    baseline_mean: float
    """The baseline's mean score over those seeds and items (an absolute level beside the delta)."""
    variant_mean: float
    """The variant's mean score over the same seeds and items."""
    mean_delta: float
    """Mean over seeds and items of variant − baseline."""
    ci_low: float
    """ci_low and ci_high: the two-level bootstrap interval."""
    ci_high: float


def two_level_bootstrap(deltas: np.ndarray, n_resamples: int = 9999, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of a (seeds x items) delta matrix, resampling seeds and items (as multinomial
    counts: a draw is two small matrix products, not an n_seeds x n_items gather)."""
    d = np.asarray(deltas, float)
    n, m = d.shape
    if n < 2 or m < 1:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    item_counts = rng.multinomial(m, np.full(m, 1 / m), size=n_resamples)      # (B, m)
    seed_counts = rng.multinomial(n, np.full(n, 1 / n), size=n_resamples)      # (B, n)
    per_seed = item_counts @ d.T / m                                             # (B, n): each seed's item mean
    means = np.einsum("bn,bn->b", seed_counts, per_seed) / n
    low, high = np.quantile(means, TAILS)
    return float(low), float(high)


def item_deltas(runs: pd.DataFrame, items: dict[str, pd.DataFrame], baseline: str, n_resamples: int = 9999,
                seed: int = 0) -> list[ItemDelta]:
    """Per (task, metric, scale, variant): the paired delta over seeds and items with its two-level interval;
    ``items`` maps a run id to its per-item rows (task, doc_id and the scores)."""
    finished = runs[(runs["status"] == "FINISHED") & runs["run_id"].isin(list(items))]
    newest = finished.sort_values("start_time").drop_duplicates(["variant", "scale", "seed"], keep="last")
    out = []
    for scale, at_scale in newest.groupby("scale", sort=False):
        base = at_scale[at_scale["variant"] == baseline].set_index("seed")
        for variant in sorted(set(at_scale["variant"]) - {baseline}):
            var = at_scale[at_scale["variant"] == variant].set_index("seed")
            seeds = sorted(set(base.index) & set(var.index))
            if not seeds:
                continue
            tables = {s: (items[base.loc[s, "run_id"]], items[var.loc[s, "run_id"]]) for s in seeds}
            tasks = sorted(set.intersection(*(set(b["task"]) & set(v["task"]) for b, v in tables.values())))
            rows = (_one(task, metric, scale, variant, baseline, tables, n_resamples, seed)
                    for task in tasks for metric in ITEM_METRICS)
            out += [row for row in rows if row is not None]
    return out


def _one(task, metric, scale, variant, baseline, tables, n_resamples, seed) -> ItemDelta | None:
    sides = []
    for b, v in tables.values():
        b, v = (t[t["task"] == task].set_index("doc_id") for t in (b, v))
        if metric not in b.columns or metric not in v.columns:
            return None
        sides.append((b[metric], v[metric]))
    common = sorted(set.intersection(*(set(b.dropna().index) & set(v.dropna().index) for b, v in sides)))
    if not common:
        return None
    base = np.array([b.loc[common].to_numpy(float) for b, _ in sides])
    var = np.array([v.loc[common].to_numpy(float) for _, v in sides])
    low, high = two_level_bootstrap(var - base, n_resamples, seed)
    return ItemDelta(task, metric, scale, variant, baseline, len(sides), len(common), _chance(tables, task, metric,
                     common), float(base.mean()), float(var.mean()), float((var - base).mean()), low, high)


def _chance(tables, task: str, metric: str, items: list) -> float:
    """Mean of 1 / n_choices over the items (every run scored the same documents, so one run's table says it)."""
    if not metric.startswith("acc"):
        return math.nan
    table = next(iter(tables.values()))[0]
    choices = table[table["task"] == task].set_index("doc_id").reindex(items).get("n_choices")
    if choices is None or choices.isna().any():
        return math.nan
    return float((1 / choices.to_numpy(float)).mean())


def read_items(client, run_ids) -> dict[str, pd.DataFrame]:
    """Per run id, the per-item scores (``evals/<id>/items.jsonl``) of each task's evaluation of record, the one tag
    ``study.eval.<task>`` names; runs without one are left out."""
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per run would flood stderr
    out = {}
    for run_id in run_ids:
        tasks_of: dict[str, set[str]] = {}
        for key, eval_id in client.get_run(run_id).data.tags.items():
            if key.startswith(TAG_EVAL):
                tasks_of.setdefault(eval_id, set()).add(key[len(TAG_EVAL):])
        rows = []
        for eval_id, tasks in sorted(tasks_of.items()):
            lines = read_artifact(client, run_id, eval_artifact(eval_id, ITEMS_ARTIFACT),
                                  lambda path: Path(path).read_text().splitlines()) or []
            rows += [row for row in map(json.loads, filter(str.strip, lines)) if row["task"] in tasks]
        if rows:
            out[run_id] = pd.DataFrame(rows)
    return out
