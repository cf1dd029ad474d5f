"""How many seed pairs a paired comparison needs, and what it can detect: the power of the paired t test and TOST.
Numpy and scipy.special only: ``study plan`` prints its power table from here, and scipy.stats takes a second to import.
"""

from __future__ import annotations

import math

MAX_PAIRS = 100_000
"""Seed pairs beyond which "seeds to decide" is reported as none (not reachable)."""


def t_power(effect: float, n: float, alpha: float, alternative: str = "two-sided") -> float:
    """Power of the one-sample (paired) t test at standardised effect ``effect`` over ``n`` pairs: the formula of
    statsmodels' ``TTestPower.power`` from scipy.special (the upper tail at ``x``, noncentrality ``nc``, is the lower
    tail at ``-x``, ``-nc``, as ``stats.nct.sf`` gives it; the far tail is the upper one at −effect)."""
    from scipy.special import nctdtr, stdtrit

    def upper(x: float, nc: float) -> float:
        tail = float(nctdtr(df, -nc, -x))
        if math.isnan(tail):  # the lower tail far from a large noncentrality: the complement of the upper one
            tail = 1.0 - float(nctdtr(df, nc, x))
        return tail if math.isfinite(tail) else float(nc > x)

    df, nc = n - 1, effect * math.sqrt(n)
    if alternative == "larger":
        return upper(-float(stdtrit(df, alpha)), nc)
    crit = -float(stdtrit(df, alpha / 2))
    return upper(crit, nc) + upper(crit, -nc)


def minimum_detectable_effect(n: int, sd: float, alpha: float, power: float) -> float:
    """Smallest true |delta| the two-sided paired t test at ``alpha`` finds with ``power`` over ``n`` pairs."""
    from scipy.optimize import brentq
    from scipy.special import ndtri

    if n < 2 or not sd > 0:
        return math.nan
    # the z test's effect is a lower bound (the t test has less power); doubling it brackets the root a few steps
    # away, where a search over [1e-9, 1e6] took most of the report's decision time
    low = (-ndtri(alpha / 2) - ndtri(1 - power)) / math.sqrt(n)
    high = 2 * low
    while t_power(high, n, alpha) < power:
        low, high = high, 2 * high
    effect = brentq(lambda e: t_power(e, n, alpha) - power, low, high, xtol=1e-12, rtol=1e-10)
    return float(effect) * sd


def _solve_pairs(effect: float, alpha: float, power: float, alternative: str) -> int | None:
    """Smallest whole number of pairs whose power reaches ``power`` (None beyond MAX_PAIRS)."""
    from scipy.special import ndtri

    if not effect > 0:
        return None
    # The normal approximation is a lower bound on the t test's n: step up from it (norm.isf(p) = -ndtri(p)).
    z = -ndtri(alpha / 2 if alternative == "two-sided" else alpha) - ndtri(1 - power)
    approx = (z / effect) ** 2
    if not approx <= MAX_PAIRS:
        return None  # a delta this small relative to its spread would need more seeds than any study trains
    n = max(2, math.floor(approx))
    while t_power(effect, n, alpha, alternative) < power:
        n += 1 if n < 64 else max(1, n // 16)
        if n > MAX_PAIRS:
            return None
    while n > 2 and t_power(effect, n - 1, alpha, alternative) >= power:
        n -= 1
    return n


def seeds_for_difference(effect: float, sd: float, alpha: float, power: float) -> int | None:
    """Pairs for the two-sided paired t test to detect a true |delta| = ``effect`` with ``power``."""
    if not sd > 0:
        return None
    return _solve_pairs(effect / sd, alpha, power, "two-sided")


def seeds_for_equivalence(true_delta: float, margin: float | None, sd: float, alpha: float, power: float
                          ) -> int | None:
    """Pairs for TOST to show |delta| < ``margin`` when the true delta is ``true_delta``, with ``power``: each
    one-sided test sized for 1 − (1 − power)/2 against the nearer bound (never an underestimate)."""
    if margin is None or not sd > 0 or abs(true_delta) >= margin:
        return None
    return _solve_pairs((margin - abs(true_delta)) / sd, alpha, 1 - (1 - power) / 2, "larger")


def seeds_to_decide(mean: float, sd: float, margin: float | None, alpha: float, power: float) -> int | None:
    """Pairs that would probably decide a comparison if the observed mean and sd are the truth: the fewer of what
    finding the delta and showing equivalence need; None when neither is reachable."""
    options = (seeds_for_difference(abs(mean), sd, alpha, power), seeds_for_equivalence(mean, margin, sd, alpha, power))
    return min((o for o in options if o is not None), default=None)


def seeds_phrase(seeds: int | None, n: int) -> str:
    """"Seeds to decide" as every place shows it: ``4 seed pairs (1 more)`` than the ``n`` paired."""
    if seeds is None:
        return "no number of seed pairs in reach"
    return f"{seeds} seed pairs" + (f" ({seeds - n} more)" if seeds > n else "")
