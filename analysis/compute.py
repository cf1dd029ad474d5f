"""Effective compute: how many times a variant's training compute the baseline needs to reach the variant's loss,
``k(C) = C_base(L_variant(C)) / C`` from :mod:`analysis.scaling` fits of final loss against training compute (each
run's FLOPs per token x tokens, or 6 N D for every run when any lacks them), read at each scale and at the centre of
the fitted range, with the interval of its paired bootstrap draws. analysis/README.md ("Effective compute").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import pandas as pd

from analysis.decide import BOOTSTRAP_MIN_N
from analysis.paired import TAILS, enclosing
from analysis.records import JsonRecord
from analysis.run_table import FINISHED, scale_order
from analysis.scaling import MIN_SCALES, ScalingFit, fit_variant, in_order

FLOPS_TIMES_TOKENS = "resolved.flops_per_token x recipe.tokens"
"""Name of the compute every run records."""

SIX_N_D = "6 N D"
"""Name of the fallback: 6 x counted parameters x training tokens."""

PERCENTILE, RANGE = "95%", "range"
"""A multiplier's interval: the percentile interval of its draws, or their range (below BOOTSTRAP_MIN_N seeds)."""


@dataclass(frozen=True)
class Multiplier(JsonRecord):
    """One variant's effective compute against the baseline at one compute."""

    variant: str
    scale: str
    """Scale name, or the fitted range (``113M–1B``) for the row read at the centre of the fit."""
    compute: float
    """The variant's training compute (FLOPs) the multiplier is read at."""
    multiplier: float
    """k: the baseline needs k times this compute to reach the variant's fitted loss there (inf: never)."""
    ci_low: float
    """Lower end of the interval of k over paired bootstrap draws (`interval` says which), never above k."""
    ci_high: float
    """Upper end of that interval, never below k (inf when more than the upper tail's share of draws never reach)."""
    draws: int
    """Bootstrap draws in which both fits converged."""
    fitted_range: bool = False
    """True for the row read at the centre of the fitted range rather than at one scale."""
    interval: str = PERCENTILE
    """``95%`` (percentile interval of the draws) or ``range`` (below BOOTSTRAP_MIN_N seeds; no coverage claimed)."""
    seeds: int = 0
    """Seeds the bootstrap resamples: the fewer of the variant's and the baseline's."""
    read_at: str = ""
    """On an L(N, D) surface: ``frontier`` or ``planned N`` (analysis.surface.FRONTIER, PLANNED); else empty."""


@dataclass(frozen=True)
class EffectiveCompute(JsonRecord):
    """Every variant's compute multiplier against the baseline, and the fits it is read from."""

    baseline: str
    """Variant the multipliers are measured against."""
    metric: str
    """Final metric fitted against compute."""
    source: str
    """How compute was counted: :data:`FLOPS_TIMES_TOKENS`, or :data:`SIX_N_D` when some run lacks those params."""
    fallback: str = ""
    """Why the fallback was taken (the runs and params missing); empty when it was not."""
    status: str = "ok"
    """``ok``, or why there are no multipliers."""
    fits: dict[str, ScalingFit] = field(default_factory=dict)
    """Per variant: final metric against its training compute."""
    rows: list[Multiplier] = field(default_factory=list)
    """Per variant other than the baseline: one row per scale, then the fitted range's row."""
    EMPTY_AS_NONE = ("fallback",)

    def headline(self) -> dict[str, Multiplier]:
        """The fitted-range row of each variant."""
        return {r.variant: r for r in self.rows if r.fitted_range}

    def at(self, scale: str, variant: str) -> Multiplier | None:
        """The row of ``variant`` at ``scale``, if any."""
        return next((r for r in self.rows if (r.scale, r.variant) == (scale, variant) and not r.fitted_range), None)


def training_compute(runs: pd.DataFrame) -> tuple[pd.Series, str, str]:
    """(compute per run in FLOPs, how it was counted, why the fallback was taken or "") of
    :func:`analysis.run_table.read_runs` rows; a run with no way to count it gets NaN and stays out of the fits."""
    finished = runs["status"] == FINISHED
    direct = runs["flops_per_token"] * runs["tokens"]
    missing = finished & direct.isna()
    if not missing.any():
        return direct, FLOPS_TIMES_TOKENS, ""
    tokens = runs["tokens"].fillna(runs["max_steps"] * runs["global_batch"] * runs["seq_len"])
    names = sorted(runs.loc[missing, "run_name"].astype(str))
    why = (f"{len(names)} finished run(s) lack resolved.flops_per_token or recipe.tokens "
           f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); every run counts 6 x params.counted x "
           "tokens (recipe.tokens, else steps x global batch x seq_len), which leaves out attention FLOPs")
    return 6.0 * runs["params_counted"] * tokens, SIX_N_D, why


def effective_compute(runs: pd.DataFrame, baseline: str, metric: str = "val/loss", n_boot: int = 200,
                      seed: int = 0, by_params: Mapping[str, ScalingFit] | None = None) -> EffectiveCompute:
    """Each variant's compute multiplier against ``baseline`` from fits of ``metric`` against training compute.

    ``by_params``: the fits against counted parameters (same ``n_boot`` and ``seed``), when made. Compute goes nearly
    as N^gamma, so each of them, with alpha / gamma, starts the compute fit of its draw near its optimum.
    """
    compute, source, fallback = training_compute(runs)
    frame = runs.assign(compute=compute)
    # in one order, whatever order the store returned them in (analysis.scaling says why a fit needs it)
    usable = in_order(frame[(frame["status"] == FINISHED) & frame[metric].notna() & frame["compute"].notna()],
                      ["variant", "compute", "seed", metric])
    base = dict(baseline=baseline, metric=metric, source=source, fallback=fallback)
    n_scales = usable["scale"].nunique()
    if n_scales < MIN_SCALES:
        return EffectiveCompute(**base, status=f"needs finished runs at {MIN_SCALES} scales ({n_scales} so far)")
    fits = {v: fit_variant(g, v, metric, n_boot, seed, "compute", *_starts(g, (by_params or {}).get(v)))
            for v, g in usable.groupby("variant")}
    reference = fits.get(baseline)
    if reference is None or reference.form == "none":
        status = reference.status if reference is not None else f"no finished {baseline} runs with a compute"
        return EffectiveCompute(**base, status=f"no baseline fit: {status}", fits=fits)
    order = scale_order(runs)
    reference_draws = reference.draws()
    rows = []
    for variant, fit in fits.items():
        if variant == baseline or fit.form == "none":
            continue
        pairs = [(v, b) for v, b in zip(fit.draws(), reference_draws) if v is not None and b is not None]
        seeds = min(usable.loc[usable["variant"] == v, "seed"].nunique() for v in (variant, baseline))
        at_scale = usable[usable["variant"] == variant].groupby("scale")["compute"].median()
        present = [s for s in order if s in at_scale.index]
        rows += [_multiplier(fit, reference, pairs, float(at_scale[s]), s, seeds) for s in present]
        rows.append(_multiplier(fit, reference, pairs, math.exp(fit.log_ref), f"{present[0]}–{present[-1]}", seeds,
                                fitted_range=True))
    return EffectiveCompute(**base, fits=fits, rows=rows)


def _starts(points: pd.DataFrame, by_params: ScalingFit | None) -> tuple[list[float] | None, list[list[float]]]:
    """(E, b, alpha) of the fit against N carried over to compute, and of each of its draws; (None, []) without one."""
    known = points[points["params_counted"].notna()]
    if by_params is None or by_params.form == "none" or known["scale"].nunique() < 2:
        return None, []
    gamma = float(np.polyfit(np.log(known["params_counted"].to_numpy(float)),
                             np.log(known["compute"].to_numpy(float)), 1)[0])
    if not gamma > 0:
        return None, []
    # with ln C = c + gamma ln N over the same points, the centred power term keeps E and b and takes alpha / gamma
    point = [by_params.E, math.log(by_params.A) - by_params.alpha * by_params.log_ref, by_params.alpha / gamma]
    return point, [[E, b, alpha / gamma] for E, b, alpha in by_params.boots]


def multiplier(variant: ScalingFit, baseline: ScalingFit, compute: float) -> float:
    """k at ``compute``: the baseline's compute for the variant's fitted loss there, over ``compute``."""
    return float(baseline.solve(variant.predict(compute))) / compute


def _multiplier(fit: ScalingFit, reference: ScalingFit, pairs: list[tuple[ScalingFit, ScalingFit]], compute: float,
                scale: str, seeds: int, fitted_range: bool = False) -> Multiplier:
    """k at ``compute`` from the point fits, its :func:`interval` from the paired draws (variant fit, baseline fit)."""
    k = multiplier(fit, reference, compute)
    kind = interval_kind(seeds)
    low, high = interval(np.array([multiplier(v, b, compute) for v, b in pairs]), k, kind)
    return Multiplier(fit.variant, scale, compute, k, low, high, len(pairs), fitted_range, kind, seeds)


def interval_kind(seeds: int) -> str:
    """:data:`PERCENTILE` from BOOTSTRAP_MIN_N seeds (too few distinct resamples below), else :data:`RANGE`."""
    return PERCENTILE if seeds >= BOOTSTRAP_MIN_N else RANGE


def interval(values: np.ndarray, point: float, kind: str) -> tuple[float, float]:
    """The percentile interval (:data:`PERCENTILE`) or range (:data:`RANGE`) of ``values``, taken out to ``point``
    (:func:`analysis.paired.enclosing`); NaN without values; inverted_cdf keeps infinite values infinite."""
    values = values[~np.isnan(values)]
    if not len(values):
        return (math.nan, math.nan)
    if kind == RANGE:
        low, high = float(values.min()), float(values.max())
    else:
        low, high = np.quantile(values, TAILS, method="inverted_cdf")
    return enclosing(float(low), float(high), float(point))
