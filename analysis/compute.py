"""Effective compute: how many times a variant's training compute the baseline needs to reach the variant's loss.

Each run's compute comes from its own records: ``resolved.flops_per_token`` (the matched model's training FLOPs per
token, attention included) times ``recipe.tokens``. Where a run lacks either, every run of the experiment falls back
to 6 N D (N = counted parameters, D = the recipe's tokens, else steps x global batch x sequence length) and the report
names the fallback: one rule for all runs, because 6 N D leaves out the attention FLOPs, which differ between arms,
and a mix of the two would shift some arms against others.

Each variant's final loss is fitted against its compute with the scaling fits of :mod:`analysis.scaling` (the same
form, Huber loss and seed-cluster bootstrap, the same draws for every variant). At a compute C of the variant,
``k(C) = C_base(L_variant(C)) / C`` with ``C_base`` the inverse of the baseline's fit: k = 1.5 says the baseline
needs 1.5 times the variant's compute to reach its loss. k is read at each scale (the variant's median compute
there) and at the centre of the fitted range (the geometric mean of the variant's observed compute, where the fit
is best determined). Its interval is the percentile interval of k over the paired bootstrap draws in which both fits
converged; a draw whose baseline fit never comes down to the variant's loss (it lies below that fit's E) counts as an
infinite k. A 95 % interval needs seeds enough to resample: below :data:`analysis.decide.BOOTSTRAP_MIN_N` seeds
(the rule the paired bootstrap follows: 2 seeds give 3 distinct resamples, 3 give 10) the interval is the range of k
over the draws instead, labelled ``range``, with no coverage claimed. Either is taken out to k itself where it
misses it (:func:`analysis.paired.enclosing`): k is a nonlinear function of two fits, so its draws need not surround
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import pandas as pd

from analysis.decide import BOOTSTRAP_MIN_N
from analysis.paired import CONFIDENCE, enclosing
from analysis.records import JsonRecord, json_ready
from analysis.run_table import FINISHED, scale_order
from analysis.scaling import MIN_SCALES, ScalingFit, fit_variant, in_order

FLOPS_TIMES_TOKENS = "resolved.flops_per_token x recipe.tokens"
"""Name of the compute every run records."""

SIX_N_D = "6 N D"
"""Name of the fallback: 6 x counted parameters x training tokens."""

PERCENTILE, RANGE = "95%", "range"
"""What a multiplier's interval is: the percentile interval of its draws, or (below BOOTSTRAP_MIN_N seeds) their
range."""


@dataclass(frozen=True)
class Multiplier(JsonRecord):
    """One variant's effective compute against the baseline at one compute."""

    variant: str
    """Variant compared."""
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
    """``95%``: the percentile interval of k over the draws; ``range``: their lowest and highest k, when fewer than
    BOOTSTRAP_MIN_N seeds leave too few distinct resamples for a 95 % interval (no coverage is claimed)."""
    seeds: int = 0
    """Seeds the bootstrap resamples: the fewer of the variant's and the baseline's."""
    read_at: str = ""
    """On an L(N, D) surface (analysis.surface): ``frontier`` (between the arms' compute-optimal frontiers) or
    ``planned N`` (at the variant's planned size, where a frontier's minimum lies beyond the searched sizes); empty
    for a fit against compute or an L(D) curve."""



@dataclass(frozen=True)
class EffectiveCompute:
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

    def headline(self) -> dict[str, Multiplier]:
        """The fitted-range row of each variant."""
        return {r.variant: r for r in self.rows if r.fitted_range}

    def at(self, scale: str, variant: str) -> Multiplier | None:
        """The row of ``variant`` at ``scale``, if any."""
        return next((r for r in self.rows if (r.scale, r.variant) == (scale, variant) and not r.fitted_range), None)

    def to_dict(self) -> dict:
        """JSON-ready dict; NaN and infinity become None."""
        return json_ready({"baseline": self.baseline, "metric": self.metric, "source": self.source,
                           "fallback": self.fallback or None, "status": self.status,
                           "fits": {v: f.to_dict() for v, f in self.fits.items()},
                           "rows": [r.to_dict() for r in self.rows]})


def training_compute(runs: pd.DataFrame) -> tuple[pd.Series, str, str]:
    """(compute per run in FLOPs, how it was counted, why the fallback was taken or "").

    ``runs`` has the columns of :func:`analysis.run_table.read_runs`. The fallback is taken when any finished run lacks
    ``resolved.flops_per_token`` or ``recipe.tokens``; a run that has neither its FLOPs nor a way to count its
    tokens gets NaN and stays out of the fits.
    """
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

    ``by_params``: the variants' fits against counted parameters (:func:`analysis.scaling.scaling_report`, drawn
    with the same ``n_boot`` and ``seed``), when made. Across a variant's runs compute goes nearly as a power of N
    (C ~ N^gamma: tokens and FLOPs per token both grow with N), so its fit against N, with alpha / gamma for alpha,
    lies next to the compute fit's optimum: it replaces the grid of nine starts, and each of its bootstrap draws
    starts the same draw's compute refit, which then converges in a few steps.
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
    """(E, b, alpha) of the fit against N carried over to compute, and of each of its bootstrap draws; (None, [])
    without a usable fit."""
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
    """k at ``compute`` from the point fits, its interval from the paired draws (variant fit, baseline fit): their
    percentile interval from BOOTSTRAP_MIN_N seeds on, their range below, either one taken out to k."""
    k = multiplier(fit, reference, compute)
    kind = PERCENTILE if seeds >= BOOTSTRAP_MIN_N else RANGE
    low, high = interval(np.array([multiplier(v, b, compute) for v, b in pairs]), k, kind)
    return Multiplier(fit.variant, scale, compute, k, low, high, len(pairs), fitted_range, kind, seeds)


def interval(values: np.ndarray, point: float, kind: str) -> tuple[float, float]:
    """The percentile interval (:data:`PERCENTILE`) or range (:data:`RANGE`) of ``values``, taken out to ``point``
    (:func:`analysis.paired.enclosing`); NaN without values. Infinite values stay infinite (inverted_cdf picks drawn
    values instead of interpolating to NaN)."""
    values = values[~np.isnan(values)]
    if not len(values):
        return (math.nan, math.nan)
    if kind == RANGE:
        low, high = float(values.min()), float(values.max())
    else:
        low, high = np.quantile(values, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2], method="inverted_cdf")
    return enclosing(float(low), float(high), float(point))
