"""Tuning in the report: each variant's LR grid (its tune runs, final loss against LR, one point per seed)
and the LR it chose (the main runs' ``study.tune.multiple`` and ``study.tune.status``), and, where the store also holds
the main runs at the shared LR, both sets of verdicts side by side with every flip flagged. Tune runs are shown,
never paired.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from analysis.decide import Decision
from analysis.records import JsonRecord
from analysis.run_table import FINISHED, TUNED, scale_order

TRANSFER = ("Other scales train at the tuned multiple of the recipe's LR rule: this assumes the best LR, as a "
            "multiple of the rule, does not move with scale (a `tune.scales` list of two or more scales fits the "
            "optimum against N instead).")
"""The transfer assumption the report states whenever main runs were tuned."""


@dataclass(frozen=True)
class TuneCurve(JsonRecord):
    """One variant's LR grid at one tune scale and what was chosen from it."""

    variant: str
    scale: str
    """Scale the tune runs trained at."""
    points: list[dict] = field(default_factory=list)
    """Every finished tune run: seed, multiple, lr, loss (its final metric)."""
    multiples: list[float] = field(default_factory=list)
    """Grid multiples with a finished run, ascending."""
    mean_losses: list[float] = field(default_factory=list)
    """Mean final loss over the seeds at each multiple."""
    best_multiple: float = math.nan
    """Grid multiple with the lowest mean loss."""
    chosen_multiple: float = math.nan
    """Multiple tuning chose (the main runs' ``study.tune.multiple``); NaN when no main run says."""
    chosen_lr: float = math.nan
    """The chosen multiple times the recipe's LR at the tune scale (a tune run's LR over its multiple)."""
    status: str | None = None
    """``interior``, ``extended`` or ``edge``, from the main runs' ``study.tune.status``."""
    main_lrs: dict[str, float] = field(default_factory=dict)
    """Peak LR the variant's main runs trained at, per scale."""
    unfinished: int = 0
    """Tune runs of this variant and scale that did not finish."""
    extensions: int | None = None
    """Grid points trained beyond the declared grid (tune.lr) while the best sat at an edge; None without that grid."""


@dataclass(frozen=True)
class VerdictPair(JsonRecord):
    """One comparison decided twice: on the runs at the shared LR and on the tuned runs."""

    metric: str
    """Final metric compared."""
    family: str
    """``primary`` or ``secondary`` (as in the decision table)."""
    scale: str
    variant: str
    """Variant compared with the baseline."""
    shared_delta: float
    """Mean paired delta at the shared LR."""
    shared_verdict: str
    """Verdict at the shared LR."""
    tuned_delta: float
    """Mean paired delta at the tuned LRs."""
    tuned_verdict: str
    """Verdict at the tuned LRs (the report's)."""
    flip: bool
    """The verdict changes between the two sets."""


def tune_curves(tune: pd.DataFrame, main: pd.DataFrame, metric: str = "val/loss",
                declared: Sequence[float] | None = None) -> list[TuneCurve]:
    """Each variant's grid at each tune scale, with the choice its main runs record; `declared` is the experiment
    file's grid (tune.lr), which tells the points added beyond it."""
    if not len(tune) or metric not in tune.columns:
        return []
    order = scale_order(pd.concat([main, tune]))
    curves = []
    for (variant, scale), runs in tune.groupby(["variant", "scale"]):
        done = runs[(runs["status"] == FINISHED) & runs[metric].notna()].sort_values(["tune_multiple", "seed"])
        points = [{"seed": int(k), "multiple": float(m), "lr": float(lr), "loss": float(loss)}
                  for k, m, lr, loss in zip(done["seed"], done["tune_multiple"], done["lr"], done[metric])]
        means = done.groupby("tune_multiple")[metric].mean().sort_index()
        mine = main[(main["variant"] == variant) & (main["lr_source"] == TUNED)]
        at_scale = mine[mine["scale"] == scale]
        # the choice made at this scale; a main run at another scale carries the multiple transferred from it
        tagged = (at_scale if len(at_scale) else mine).dropna(subset=["tune_multiple"])
        chosen = float(tagged["tune_multiple"].mode().iloc[0]) if len(tagged) else math.nan
        status = tagged["tune_status"].dropna()
        recipe_lr = float(np.median(done["lr"] / done["tune_multiple"])) if len(done) else math.nan
        lrs = mine.groupby("scale")["lr"].median()
        curves.append(TuneCurve(
            variant, scale, points, [float(m) for m in means.index], [float(v) for v in means],
            float(means.idxmin()) if len(means) else math.nan, chosen, chosen * recipe_lr,
            str(status.mode().iloc[0]) if len(status) else None,
            {s: float(lrs[s]) for s in order if s in lrs.index}, int((runs["status"] != FINISHED).sum()),
            None if declared is None else sum(not any(math.isclose(m, d, rel_tol=1e-5) for d in declared)
                                              for m in runs["tune_multiple"].dropna().unique())))
    return sorted(curves, key=lambda c: (order.index(c.scale) if c.scale in order else len(order), c.variant))


def verdict_pairs(shared: Sequence[Decision], tuned: Sequence[Decision]) -> list[VerdictPair]:
    """Every comparison decided in both sets, in the tuned set's order, flagged where the verdict changes."""
    before = {(d.metric, d.scale, d.variant): d for d in shared}
    return [VerdictPair(d.metric, d.family, d.scale, d.variant, s.mean_delta, s.verdict, d.mean_delta, d.verdict,
                        s.verdict != d.verdict)
            for d in tuned if (s := before.get((d.metric, d.scale, d.variant))) is not None]
