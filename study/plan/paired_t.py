"""The paired t test, its TOST and Holm's step-down: the one implementation every verdict of study is reached with.

The report's decisions (:func:`analysis.decide.decide`), the race's rungs and the plan's simulation of many races
(:func:`study.plan.racing.race_arrays`) all test here, along the last axis of arrays of any shape. The t distribution
is :func:`scipy.special.stdtr` (scipy.stats takes a second to import); Holm and TOST are a few lines on it because
statsmodels' take one family at a time and its Holm collects garbage on every call, which a simulation of thousands
of races cannot pay. tests/test_decide.py checks all three against scipy and statsmodels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VERDICTS = ("better", "worse", "equivalent", "undecided")
"""What a comparison is decided to be, in the order the report counts them."""

MIN_PAIRS = 2
"""Fewest pairs a t test is made on: the sd of the deltas needs two (a comparison on fewer stays undecided)."""


@dataclass(frozen=True)
class PairedT:
    """The paired t test of deltas (variant - baseline) against 0, along their last axis."""

    n: int
    """Pairs (the last axis' length)."""
    mean: np.ndarray
    """Mean delta."""
    se: np.ndarray
    """Standard error of the mean: the sample sd (ddof=1) over sqrt(n)."""
    p: np.ndarray
    """Two-sided p of t = mean / se on n - 1 degrees of freedom (scipy.stats.ttest_1samp's)."""

    def tost(self, margin: float) -> np.ndarray:
        """TOST p for |delta| < ``margin``: the larger one-sided p (statsmodels' ttost_paired)."""
        from scipy.special import stdtr

        with np.errstate(divide="ignore", invalid="ignore"):
            above_low = stdtr(self.n - 1, -(self.mean + margin) / self.se)
            below_high = stdtr(self.n - 1, (self.mean - margin) / self.se)
        return np.maximum(above_low, below_high)


def paired_t(deltas: np.ndarray) -> PairedT:
    """The paired t test of ``deltas`` along the last axis (at least two pairs; a zero spread gives NaN or 0)."""
    from scipy.special import stdtr

    d = np.asarray(deltas, float)
    n = d.shape[-1]
    if n < MIN_PAIRS:
        raise ValueError(f"a paired t test needs at least {MIN_PAIRS} pairs, not {n}")
    mean = d.mean(axis=-1)
    se = np.sqrt(d.var(axis=-1, ddof=1) / n)  # as scipy.stats.ttest_1samp computes it, to the last bit
    with np.errstate(divide="ignore", invalid="ignore"):
        p = 2 * stdtr(n - 1, -np.abs(mean / se))
    return PairedT(n, mean, se, p)


def holm(p: np.ndarray, tested: np.ndarray | None = None) -> np.ndarray:
    """Holm-adjusted p along the last axis (statsmodels' ``multipletests(p, method="holm")``) over the entries
    ``tested`` marks; the others are inf."""
    p = np.asarray(p, float)
    tested = np.ones(p.shape, bool) if tested is None else np.broadcast_to(tested, p.shape)
    p = np.where(tested, p, np.inf)
    order = np.argsort(p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)
    m = tested.sum(axis=-1, keepdims=True)
    finite = np.isfinite(ranked)
    # p_(i) x (m - i), capped at 1, then the running maximum: a hypothesis is rejected only after every smaller p is
    scaled = np.where(finite, np.minimum(1.0, np.where(finite, ranked, 0.0) * (m - np.arange(p.shape[-1]))), np.inf)
    adjusted = np.maximum.accumulate(scaled, axis=-1)
    out = np.empty_like(adjusted)
    np.put_along_axis(out, order, adjusted, axis=-1)
    return out
