"""Paired-seed differences against the baseline variant, with their uncertainty: runs sharing (scale, seed) share
data order and initialisation, so ``delta = variant - baseline`` per seed cancels most seed noise. Per (scale,
variant): the mean delta, a paired t interval, a bootstrap interval over seeds, the Wilcoxon p and the win rate;
runs that cannot be paired are returned with the reason, never dropped silently.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from analysis.records import JsonRecord
from analysis.run_table import FINISHED, scale_order
from study.errors import StudyError

CONFIDENCE = 0.95
"""Coverage of every interval in the report."""

TAILS = ((1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2)
"""The quantiles that bound a CONFIDENCE percentile interval."""

_LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "bits_per_byte", "bpb")


@dataclass(frozen=True)
class UnpairedRun:
    """A run left out of a comparison, and why."""

    run_id: str
    run_key: str | None
    """The study's run key, when known."""
    variant: str
    scale: str
    seed: int
    status: str
    """MLflow status of the run."""
    reason: str
    """Why it cannot be paired."""


@dataclass(frozen=True)
class PairedResult(JsonRecord):
    """Variant minus baseline on one metric at one scale, over the seeds both finished."""

    scale: str
    variant: str
    baseline: str
    metric: str
    """MLflow metric key (final value)."""
    n: int
    """Number of (scale, seed) pairs."""
    mean_delta: float
    """Mean of variant minus baseline; negative means lower than the baseline."""
    sd_delta: float
    """Sample standard deviation (ddof=1) of the deltas; NaN when n < 2."""
    ci_low: float
    """ci_low and ci_high: the paired t interval."""
    ci_high: float
    boot_ci_low: float
    """boot_ci_low and boot_ci_high: the bootstrap interval over seeds, taken out to the mean (`enclosing`)."""
    boot_ci_high: float
    p_wilcoxon: float
    """Two-sided Wilcoxon signed-rank p; NaN when n < 2 or every delta is zero."""
    win_rate: float
    """Fraction of pairs where the variant is strictly better, in the metric's direction."""
    boot_method: str
    """``BCa``, ``percentile`` (BCa degenerate: n = 2 or equal deltas) or ``none`` (n < 2)."""
    higher_is_better: bool
    """Direction used for the win rate."""
    seeds: list[int] = field(default_factory=list)
    """Seeds of the pairs."""
    deltas: list[float] = field(default_factory=list)
    """The per-seed deltas, in seed order."""
    unpaired: list[UnpairedRun] = field(default_factory=list)
    """Runs of this scale and of these two variants that could not be paired."""


@dataclass(frozen=True)
class JointResult(JsonRecord):
    """Mean across several metrics of variant minus baseline, bootstrapped with seeds resampled jointly."""

    scale: str
    variant: str
    baseline: str
    metrics: list[str]
    """The metrics averaged."""
    n: int
    """Seeds with every metric on both sides."""
    mean_delta: float
    """Mean over metrics of the mean delta."""
    boot_ci_low: float
    """boot_ci_low and boot_ci_high: the joint bootstrap interval, taken out to the mean (`enclosing`)."""
    boot_ci_high: float
    boot_method: str
    """``BCa``, ``percentile`` or ``none``."""
    seeds: list[int] = field(default_factory=list)
    """Seeds used."""


def is_higher_better(metric: str) -> bool:
    """Direction of a metric: losses and perplexities are lower-is-better, other ``eval/*`` scores higher."""
    last = metric.rsplit("/", 1)[-1].lower()
    if any(word in last for word in _LOWER_IS_BETTER):
        return False
    if metric.startswith("eval/"):
        return True
    raise StudyError("higher_is_better", f"cannot tell whether higher or lower {metric!r} is better",
                     "choose a loss, perplexity or eval/* metric, or call paired_deltas with higher_is_better set")


def paired_deltas(df: pd.DataFrame, metric: str, baseline: str, higher_is_better: bool | None = None,
                  n_resamples: int = 9999, seed: int = 0) -> list[PairedResult]:
    """Per (scale, variant != baseline) of :func:`analysis.run_table.read_runs` rows: paired statistics of ``metric``
    against ``baseline``, over FINISHED runs with a finite value (the rest in ``unpaired``). The bootstrap is seeded;
    ``n_resamples=0`` skips it (no decision uses it)."""
    _check(df, [metric], baseline)
    df = _narrow(df, [metric])
    better_high = is_higher_better(metric) if higher_is_better is None else higher_is_better
    results = []
    for scale, variant, paired, unpaired in _comparisons(df, baseline, [metric]):
        deltas = paired[f"{metric}|v"].to_numpy(float) - paired[f"{metric}|b"].to_numpy(float)
        results.append(_summarise(scale, variant, baseline, metric, paired["seed"].tolist(), deltas, unpaired,
                                  better_high, n_resamples, seed))
    return results


def joint_bootstrap(df: pd.DataFrame, metrics: Sequence[str], baseline: str, n_resamples: int = 9999, seed: int = 0
                    ) -> list[JointResult]:
    """Per (scale, variant): the interval of the mean-across-metrics delta, each draw resampling whole seeds for every
    metric, so a seed lucky on all tasks stays lucky in the resample. Metrics must share a direction."""
    metrics = list(metrics)
    _check(df, metrics, baseline)
    if len({is_higher_better(m) for m in metrics}) > 1:
        raise StudyError("metrics", f"{metrics} mix higher- and lower-is-better metrics",
                         "average only metrics of one direction")
    results = []
    for scale, variant, paired, _ in _comparisons(_narrow(df, metrics), baseline, metrics):
        # the mean over tasks of per-task mean deltas is the mean over seeds of each seed's task-mean delta, so
        # resampling rows of that per-seed vector is exactly resampling seeds jointly for every task
        per_seed = np.mean([paired[f"{m}|v"].to_numpy(float) - paired[f"{m}|b"].to_numpy(float)
                            for m in metrics], axis=0)
        low, high, method = _bootstrap(per_seed, n_resamples, seed)
        mean = float(per_seed.mean()) if len(per_seed) else math.nan
        low, high = enclosing(low, high, mean)
        results.append(JointResult(scale, variant, baseline, metrics, len(per_seed), mean, low, high, method,
                                   paired["seed"].tolist()))
    return results


def _comparisons(df: pd.DataFrame, baseline: str, metrics: Sequence[str]):
    """(scale, variant, seed-aligned pairs, unpaired runs) of every variant but the baseline, scale by scale."""
    for scale in scale_order(df):
        at_scale = df[df["scale"] == scale]
        for variant in sorted(set(at_scale["variant"]) - {baseline}):
            yield scale, variant, *_pairs(at_scale, variant, baseline, metrics)


def _check(df: pd.DataFrame, metrics: Sequence[str], baseline: str) -> None:
    variants = sorted(df["variant"].unique())
    if baseline not in variants:
        raise StudyError("baseline", f"no runs of variant {baseline!r}", f"choose one of: {', '.join(variants)}")
    present = sorted(c for c in df.columns if "/" in c)
    for metric in metrics:
        if metric not in present:
            raise StudyError("metric", f"no run logged {metric!r}", f"choose from: {', '.join(present) or '(none)'}")


_PAIRING = ("run_id", "run_key", "variant", "scale", "seed", "status", "failure_reason", "start_time",
            "params_counted")
"""The columns pairing reads besides the metrics (params_counted orders the scales)."""


def _narrow(df: pd.DataFrame, metrics: Sequence[str]) -> pd.DataFrame:
    """Only the columns pairing reads, strings as Python objects (copying Arrow-backed strings on every row selection
    was most of the report's statistics time)."""
    narrow = df[[c for c in _PAIRING if c in df.columns] + list(metrics)]
    return narrow.astype({c: object for c in narrow.columns if pd.api.types.is_string_dtype(narrow[c])})


def _pairs(at_scale: pd.DataFrame, variant: str, baseline: str, metrics: Sequence[str]
           ) -> tuple[pd.DataFrame, list[UnpairedRun]]:
    """Seed-aligned finished runs of both sides, and every run of either side that cannot be used."""
    unpaired: list[UnpairedRun] = []
    chosen = {}
    for name in (variant, baseline):
        runs = at_scale[at_scale["variant"] == name]
        usable = (runs["status"] == FINISHED) & np.isfinite(runs[list(metrics)].to_numpy(float)).all(axis=1)
        for _, run in runs[~usable].iterrows():
            why = f"status {run['status']}" if run["status"] != FINISHED else f"no final {', '.join(metrics)}"
            if isinstance(run.get("failure_reason"), str):
                why += f": {run['failure_reason']}"
            unpaired.append(_unpaired(run, why))
        # A relaunch under a changed config can leave two runs for one seed: the newest one counts.
        ok = runs[usable].sort_values("start_time")
        for _, run in ok[ok.duplicated("seed", keep="last")].iterrows():
            unpaired.append(_unpaired(run, "superseded by a newer run with the same variant, scale and seed"))
        chosen[name] = ok.drop_duplicates("seed", keep="last").set_index("seed")
    v, b = chosen[variant], chosen[baseline]
    for side, other, other_name in ((v, b, baseline), (b, v, variant)):
        for seed in sorted(set(side.index) - set(other.index)):
            unpaired.append(_unpaired(side.loc[seed], f"no usable {other_name} run with seed {seed}", seed))
    seeds = sorted(set(v.index) & set(b.index))
    paired = pd.DataFrame({"seed": seeds})
    for m in metrics:
        paired[f"{m}|v"] = v.loc[seeds, m].to_numpy(float)
        paired[f"{m}|b"] = b.loc[seeds, m].to_numpy(float)
    return paired, unpaired


def _unpaired(run: pd.Series, reason: str, seed: int | None = None) -> UnpairedRun:
    return UnpairedRun(run["run_id"], run["run_key"], run["variant"], run["scale"],
                       int(run["seed"] if seed is None else seed), run["status"], reason)


def spread(deltas: np.ndarray) -> float:
    """The deltas' sample sd, 0 when equal up to rounding (no test reads rounding as spread); NaN below 2 pairs."""
    if len(deltas) < 2:
        return math.nan
    if np.allclose(deltas, deltas[0], rtol=1e-9, atol=1e-12):
        return 0.0
    return float(np.std(deltas, ddof=1))


def t_interval(level: float, n: int, mean: float, sd: float) -> tuple[float, float]:
    """The t interval at ``level`` of the mean of ``n`` paired deltas whose sample sd is ``sd``."""
    from scipy import stats

    low, high = stats.t.interval(level, n - 1, loc=mean, scale=sd / math.sqrt(n))
    return float(low), float(high)


def _summarise(scale: str, variant: str, baseline: str, metric: str, seeds: list[int], deltas: np.ndarray,
               unpaired: list[UnpairedRun], better_high: bool, n_resamples: int, seed: int) -> PairedResult:
    from scipy import stats

    n = len(deltas)
    mean = float(np.mean(deltas)) if n else math.nan
    sd = spread(deltas)
    ci = (math.nan, math.nan) if n < 2 else (mean, mean) if sd == 0 else t_interval(CONFIDENCE, n, mean, sd)
    boot_low, boot_high, method = (_bootstrap(deltas, n_resamples, seed) if n_resamples > 0
                                   else (math.nan, math.nan, "none"))
    boot_low, boot_high = enclosing(boot_low, boot_high, mean)
    p = float(stats.wilcoxon(deltas).pvalue) if n >= 2 and np.any(deltas != 0) else math.nan
    wins = deltas > 0 if better_high else deltas < 0
    win_rate = float(np.mean(wins)) if n else math.nan
    return PairedResult(scale, variant, baseline, metric, n, mean, sd, ci[0], ci[1], boot_low, boot_high, p, win_rate,
                        method, better_high, [int(s) for s in seeds], [float(d) for d in deltas], unpaired)


def _bootstrap(per_seed: np.ndarray, n_resamples: int, seed: int) -> tuple[float, float, str]:
    """The bootstrap interval of the mean over seeds: BCa where defined, else percentile; none below two seeds."""
    from scipy import stats

    def run(method: str):
        return stats.bootstrap((per_seed,), np.mean, vectorized=True, confidence_level=CONFIDENCE,
                               n_resamples=n_resamples, method=method, rng=seed).confidence_interval

    n = len(per_seed)
    if n < 2:
        return math.nan, math.nan, "none"
    if n >= 3 and np.ptp(per_seed) > 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ci = run("BCa")
        if np.isfinite(ci.low) and np.isfinite(ci.high):
            return float(ci.low), float(ci.high), "BCa"
    ci = run("percentile")
    return float(ci.low), float(ci.high), "percentile"


def enclosing(low: float, high: float, point: float) -> tuple[float, float]:
    """[low, high] taken out to `point` where it misses it (a percentile or BCa interval over few resamples, or of a
    nonlinear statistic, need not hold its estimate); an interval not computed (NaN) stays as it is."""
    if math.isnan(low) or math.isnan(high) or math.isnan(point):
        return low, high
    return min(low, point), max(high, point)
