"""The decision table: one verdict per (scale, variant, metric) on the paired deltas (:mod:`analysis.paired`).
*better* / *worse* when the paired t test rejects after the family's correction (Holm over the primary family, BH over
the secondary metrics), *equivalent* when TOST does, else *undecided* with the seeds that would probably decide it;
beside it the t interval it agrees with (:func:`adjusted_interval`). analysis/README.md ("Deciding") says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from analysis.paired import PairedResult, spread, t_interval
from analysis.power import minimum_detectable_effect, seeds_phrase, seeds_to_decide
from analysis.records import JsonRecord
from study.config.decision import DecisionRule
from study.plan.paired_t import holm, paired_t

BOOTSTRAP_MIN_N = 8
"""Below this many pairs the bootstrap interval is omitted (3 seeds give 10 distinct resamples)."""

SIGNFLIP_EXACT_MAX_N = 16
"""Up to this many pairs the sign-flip p enumerates all 2^n sign patterns; above, 99,999 random flips."""

VERDICT_COLORS = {"better": "#1a7f37", "worse": "#cf222e", "equivalent": "#0969da", "undecided": "#6e7781"}
"""One colour per verdict, shared by the forest plots and the report's tables."""

CORRECTION = {"primary": "Holm", "secondary": "BH"}
"""Each family's multiplicity correction as the report and the terminal name it (BH: Benjamini-Hochberg)."""


@dataclass(frozen=True)
class Decision(JsonRecord):
    """One row of the decision table."""

    scale: str
    variant: str
    baseline: str
    metric: str
    """Final metric compared."""
    family: str
    """``primary`` (Holm) or ``secondary`` (Benjamini-Hochberg)."""
    n: int
    """Seed pairs."""
    mean_delta: float
    """Mean of variant − baseline."""
    pct_delta: float
    """mean_delta as a percentage of the baseline's mean over the same seeds."""
    sd_delta: float
    """Sample sd (ddof=1) of the deltas."""
    ci_low: float
    """ci_low and ci_high: the paired t interval at 1 − alpha."""
    ci_high: float
    adj_ci_low: float
    """adj_ci_low and adj_ci_high: the multiplicity-adjusted t interval the verdict uses (:func:`adjusted_interval`)."""
    adj_ci_high: float
    p_t: float
    """Two-sided paired t p (:func:`study.plan.paired_t.paired_t`: scipy's t, as scipy.stats.ttest_rel)."""
    p_adjusted: float
    """p_t after the family's correction (Holm or BH)."""
    p_signflip: float
    """Two-sided sign-flip permutation p of the mean delta (exact up to SIGNFLIP_EXACT_MAX_N pairs)."""
    p_wilcoxon: float
    """Two-sided Wilcoxon signed-rank p."""
    d_z: float
    """Standardised paired effect, mean_delta / sd_delta."""
    prob_improvement: float
    """Share of seeds where the variant is better (ties count one half)."""
    mde: float
    """Smallest |delta| the t test detects with the rule's power at this n and alpha (in metric units)."""
    margin: float | None
    """Equivalence margin, when declared for this metric."""
    p_tost: float
    """TOST p for |delta| < margin (:meth:`study.plan.paired_t.PairedT.tost`); NaN without a margin."""
    p_tost_adjusted: float
    """p_tost after the family's correction."""
    verdict: str
    """better, worse, equivalent or undecided."""
    seeds_to_decide: int | None
    """Undecided only: pairs that would probably decide it (see :func:`seeds_to_decide`)."""
    reason: str
    """Why the verdict is what it is, in words."""
    boot_ci_low: float
    """boot_ci_low and boot_ci_high: the descriptive bootstrap interval, from BOOTSTRAP_MIN_N pairs on."""
    boot_ci_high: float
    higher_is_better: bool
    """Direction of the metric."""
    alpha: float
    """Error rate the verdict was reached at (after any sequential spending)."""

    @classmethod
    def from_dict(cls, row: Mapping) -> "Decision":
        """Inverse of :meth:`to_dict` (None back to NaN for a float); an older row gets its adjusted interval here."""
        floats = {name for name, f in cls.__dataclass_fields__.items() if f.type == "float"}
        fields = {k: (math.nan if v is None and k in floats else v) for k, v in row.items()
                  if k in cls.__dataclass_fields__}
        if "adj_ci_low" not in fields:
            fields["adj_ci_low"], fields["adj_ci_high"] = adjusted_interval(
                fields["n"], fields["mean_delta"], fields["sd_delta"], fields["p_t"], fields["p_adjusted"],
                fields["alpha"])
        return cls(**fields)


def adjusted_interval(n: int, mean: float, sd: float, p: float, p_adjusted: float, alpha: float
                      ) -> tuple[float, float]:
    """The paired t interval at 1 − α·p/p_adjusted, the level the family's correction tested this row at: it excludes
    0 exactly when ``p_adjusted`` < α. NaN where no t test was possible."""
    if n < 2 or not sd > 0 or not (math.isfinite(p) and math.isfinite(p_adjusted)):
        return math.nan, math.nan
    level_alpha = alpha * p / p_adjusted if p_adjusted > 0 else alpha  # p_adjusted 0: p is 0, any level excludes 0
    return t_interval(1 - level_alpha, n, mean, sd)


def decide(results: Mapping[str, Sequence[PairedResult]], rule: DecisionRule,
           baseline_means: Mapping[tuple[str, str, str], float] | None = None, alpha: float | None = None
           ) -> list[Decision]:
    """Verdicts for every paired result (``results`` by metric). ``alpha`` overrides the rule's (a sequential look
    spends part of it); ``baseline_means`` by (metric, scale, variant) give the percentage column."""
    from statsmodels.stats.multitest import multipletests

    alpha = rule.alpha if alpha is None else alpha
    rows = [_statistics(r, rule, alpha, (baseline_means or {}).get((r.metric, r.scale, r.variant)))
            for metric in results for r in results[metric]]
    correct = {"primary": holm, "secondary": lambda p: multipletests(p, alpha=alpha, method="fdr_bh")[1]}
    for family, adjust in correct.items():
        members = [i for i, row in enumerate(rows) if row["family"] == family]
        for p_key, adjusted_key in (("p_t", "p_adjusted"), ("p_tost", "p_tost_adjusted")):
            idx = [i for i in members if math.isfinite(rows[i][p_key])]
            if idx:
                adjusted = adjust(np.array([rows[i][p_key] for i in idx]))
                for i, p in zip(idx, adjusted):
                    rows[i][adjusted_key] = float(p)
    m_primary = sum(1 for row in rows if row["family"] == "primary")
    out = []
    for row in rows:
        row["adj_ci_low"], row["adj_ci_high"] = adjusted_interval(row["n"], row["mean_delta"], row["sd_delta"],
                                                                  row["p_t"], row["p_adjusted"], alpha)
        # Planning alpha for an undecided primary row: Bonferroni's alpha/m bounds Holm's strictest step.
        plan_alpha = alpha / max(m_primary, 1) if row["family"] == "primary" else alpha
        out.append(Decision(**_verdict(row, alpha, rule.power, plan_alpha, rule.prior_sd), alpha=alpha))
    return out


def _statistics(r: PairedResult, rule: DecisionRule, alpha: float, baseline_mean: float | None) -> dict:
    d = np.asarray(r.deltas, float)
    n = len(d)
    sd = spread(d)
    mean = float(d.mean()) if n else math.nan
    row = dict(scale=r.scale, variant=r.variant, baseline=r.baseline, metric=r.metric,
               family="primary" if r.metric == rule.metric else "secondary", n=n, mean_delta=mean,
               pct_delta=100 * mean / baseline_mean if baseline_mean else math.nan, sd_delta=sd,
               ci_low=math.nan, ci_high=math.nan, p_t=math.nan, p_adjusted=math.nan, p_signflip=math.nan,
               p_wilcoxon=r.p_wilcoxon, d_z=math.nan, prob_improvement=math.nan, mde=math.nan,
               margin=rule.margin_of(r.metric), p_tost=math.nan, p_tost_adjusted=math.nan,
               boot_ci_low=math.nan, boot_ci_high=math.nan, higher_is_better=r.higher_is_better)
    if n:
        better = d > 0 if r.higher_is_better else d < 0
        row["prob_improvement"] = float(np.mean(better) + 0.5 * np.mean(d == 0))
    if n >= BOOTSTRAP_MIN_N:
        row["boot_ci_low"], row["boot_ci_high"] = r.boot_ci_low, r.boot_ci_high
    if n < 2 or not sd > 0:
        return row
    row["ci_low"], row["ci_high"] = t_interval(1 - alpha, n, mean, sd)
    test = paired_t(d)
    row.update(p_t=float(test.p), p_signflip=signflip_p(d), d_z=mean / sd,
               mde=minimum_detectable_effect(n, sd, alpha, rule.power))
    if row["margin"] is not None:
        row["p_tost"] = float(test.tost(row["margin"]))
    return row


def _verdict(row: dict, alpha: float, power: float, plan_alpha: float, prior_sd: float | None) -> dict:
    n = row["n"]
    good_up = row["higher_is_better"]
    seeds = None
    if n < 2 or not math.isfinite(row["p_t"]):
        verdict = "undecided"
        reason = ("fewer than 2 seed pairs" if n < 2 else "every delta is identical: no spread to test against")
        if prior_sd and row["family"] == "primary":  # no spread measured yet: the experiment's prior stands in
            observed = row["mean_delta"] if math.isfinite(row["mean_delta"]) else 0.0
            seeds = seeds_to_decide(observed, prior_sd, row["margin"], plan_alpha, power)
            reason += (f"; {seeds_phrase(seeds, n)} would probably decide it at the prior sd {prior_sd:g}"
                       if seeds else "")
    elif row["p_adjusted"] < alpha:
        verdict = "better" if (row["mean_delta"] > 0) == good_up else "worse"
        reason = f"adjusted p {row['p_adjusted']:.3g} < {alpha:g}"
    elif math.isfinite(row["p_tost_adjusted"]) and row["p_tost_adjusted"] < alpha:
        verdict = "equivalent"
        reason = f"TOST adjusted p {row['p_tost_adjusted']:.3g}: |Δ| < {row['margin']:g}"
    else:
        verdict = "undecided"
        seeds = seeds_to_decide(row["mean_delta"], row["sd_delta"], row["margin"], plan_alpha, power)
        reason = (f"adjusted p {row['p_adjusted']:.3g}"
                  + (f", TOST adjusted p {row['p_tost_adjusted']:.3g}" if row["margin"] is not None else
                     ", no equivalence margin declared")
                  + (f"; {seeds_phrase(seeds, n)} would probably decide it" if seeds else ""))
    return {**row, "verdict": verdict, "seeds_to_decide": seeds, "reason": reason}


def signflip_p(deltas: np.ndarray, seed: int = 0) -> float:
    """Two-sided sign-flip permutation p of the mean (scipy.stats.permutation_test), exact for small n."""
    from scipy import stats

    d = np.asarray(deltas, float)
    exact = len(d) <= SIGNFLIP_EXACT_MAX_N
    res = stats.permutation_test((d,), lambda x, axis=-1: np.mean(x, axis=axis), permutation_type="samples",
                                 vectorized=True, n_resamples=np.inf if exact else 99_999,
                                 alternative="two-sided", rng=seed)
    return float(res.pvalue)


