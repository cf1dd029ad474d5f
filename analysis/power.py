"""How many seed pairs a paired comparison needs, and what it can detect: the power of the paired t test and TOST
(what the report's "seeds to decide" and MDE are), and power before spending: per comparison of a plan, the seeds that
resolve the declared margin and the GPU-hours they cost. The noise is the sd of paired deltas measured in the store
(from :data:`MIN_PAIRS_FOR_SD` finished pairs), else the experiment's ``decision.prior_sd``; resolving means finding a
true difference of one margin (paired t) and showing a true 0 equivalent (TOST), each with the rule's power at the
family's Bonferroni level alpha/m. Numpy and scipy.special only: ``study plan`` prints its power table from here, and
scipy.stats takes a second to import.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from study.config.decision import DecisionRule

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


MIN_PAIRS_FOR_SD = 3
"""Finished pairs of a comparison before its measured sd replaces the prior."""


@dataclass(frozen=True)
class PowerRow:
    """The seeds one (scale, variant) comparison needs."""

    scale: str
    variant: str
    """Variant compared with the baseline."""
    sd: float | None
    """sd of paired deltas used (None: neither measured nor a prior)."""
    source: str
    """Where the sd comes from: ``measured (n pairs)``, ``prior`` or ``none``."""
    seeds_difference: int | None
    """Pairs to find a true |delta| = margin."""
    seeds_equivalence: int | None
    """Pairs to show equivalence when the true delta is 0."""
    seeds_needed: int | None
    """The larger of the two: the pairs that resolve the comparison either way."""
    planned: int
    """Seeds the experiment file plans at this scale."""
    gpu_hours: float | None
    """GPU-hours of seeds_needed pairs (variant and baseline runs)."""
    hours_from_baseline: bool = False
    """The variant's widths wait for a profile, so its runs are costed at the baseline's (the budgets match)."""

    def to_dict(self) -> dict:
        return asdict(self)


def plan_power(plan, rule: DecisionRule, measured: dict[tuple[str, str], tuple[float, int]] | None = None
               ) -> list[PowerRow]:
    """One row per (scale, variant other than the baseline) of ``plan`` (a :class:`study.plan.planner.Plan`)."""
    exp = plan.experiment
    others = [v.name for v in exp.variants if v.name != exp.baseline]
    m = max(1, len(others) * len(exp.scales))
    alpha = rule.alpha / m
    hours = {(r.config.variant, r.config.scale): r.gpu_hours() for r in plan.runs}
    rows = []
    for scale in exp.scales:
        for variant in others:
            sd, source = None, "none"
            if measured and (scale, variant) in measured:
                sd, n = measured[scale, variant]
                source = f"measured ({n} pairs)"
            elif rule.prior_sd:
                sd, source = rule.prior_sd, "prior"
            diff = equiv = None
            if sd and rule.margin:
                diff = seeds_for_difference(rule.margin, sd, alpha, rule.power)
                equiv = seeds_for_equivalence(0.0, rule.margin, sd, alpha, rule.power)
            needed = max((x for x in (diff, equiv) if x is not None), default=None)
            base_hours, var_hours = hours.get((exp.baseline, scale)), hours.get((variant, scale))
            borrowed = var_hours is None and base_hours is not None
            var_hours = base_hours if borrowed else var_hours
            cost = needed * (var_hours + base_hours) if needed and None not in (var_hours, base_hours) else None
            rows.append(PowerRow(scale, variant, sd, source, diff, equiv, needed, len(exp.seeds[scale]), cost,
                                 borrowed))
    return rows


def measured_noise(experiment: str, baseline: str, rule: DecisionRule, tracking_uri: str
                   ) -> tuple[dict[tuple[str, str], tuple[float, int]], str]:
    """(scale, variant) -> (sd of paired deltas, pairs) for comparisons with enough finished pairs, and a note on
    what was read. Planning never waits on a store: a server is asked once with a short timeout, and a store that
    cannot be read gives {} and is named in the note."""
    from unittest.mock import patch

    from study.errors import StudyError
    from study.track.store import read_per_version, resolve_tracking_uri, sqlite_path

    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        return {}, f"no store at {db} yet"

    def read() -> list:
        from analysis.paired import paired_deltas  # pandas and MLflow: only where there is a store to read
        from analysis.run_table import read_runs

        try:
            runs = read_runs(experiment, uri)
        except StudyError as err:  # the experiment is not in this version of the store: an answer, kept
            return [[], err.problem]
        if rule.metric not in runs.columns or baseline not in set(runs["variant"]):
            return [[], f"no finished {baseline} runs with {rule.metric} in the store yet"]
        results = paired_deltas(runs, rule.metric, baseline, n_resamples=0)
        rows = [[r.scale, r.variant, r.sd_delta, r.n] for r in results
                if r.n >= MIN_PAIRS_FOR_SD and math.isfinite(r.sd_delta) and r.sd_delta > 0]
        return [rows, f"measured for {len(rows)} comparisons with at least {MIN_PAIRS_FOR_SD} finished pairs"]

    try:
        with patch.dict(os.environ, {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}):
            rows, note = read_per_version(uri, ["paired noise", experiment, baseline, rule.metric], read)
    except StudyError as err:
        return {}, err.problem
    except Exception as err:  # a server that is down must not stop planning; the note says so
        return {}, f"the store could not be read ({type(err).__name__})"
    return {(scale, variant): (sd, n) for scale, variant, sd, n in rows}, note


def plan_power_rows(plan, unread: str | None = None) -> tuple[list, str]:
    """Power rows of a plan (study.plan.planner.Plan) with a decision margin, and where the noise came from; `unread`
    says why the store is not read (its server did not answer), and the prior stands in."""
    exp = plan.experiment
    rule = exp.decision
    if rule.margin is None or not plan.runs:
        return [], "no decision.margin declared: no power analysis"
    if unread:
        return plan_power(plan, rule), f"{unread}: decision.prior_sd is used"
    measured, note = measured_noise(exp.name, exp.baseline, rule, plan.runs[0].config.tracking.uri)
    return plan_power(plan, rule, measured), note
