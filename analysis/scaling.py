"""Loss-versus-parameters fits per variant, ``L(N) = E + A * N^(-alpha)``, and where two variants' fits cross.

The fit is done in a centred form, ``L = E + exp(b - alpha * (ln N - ln N_ref))`` with N_ref the geometric mean
of the observed sizes, because ``A`` in raw units spans many orders of magnitude and is nearly collinear with
``alpha``; ``A = exp(b + alpha * ln N_ref)`` is reported back in raw units. The saturating law has three
parameters, so it needs at least four distinct scales; with two or three the irreducible loss E is fixed at 0
(a pure power law), and with one there is nothing to fit.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from analysis.paired import CONFIDENCE, json_ready
from analysis.runs import FINISHED

MIN_SCALES_SATURATING = 4
"""Distinct scales needed for the three-parameter law; fewer fall back to a pure power law."""

EXTRAPOLATE = 100.0
"""Crossings are searched up to this multiple of the largest observed size unless a range is given."""


@dataclass(frozen=True)
class ScalingFit:
    """One variant's fit of a final metric against counted parameters."""

    variant: str
    """Variant fitted."""
    metric: str
    """Metric fitted (final value)."""
    form: str
    """``E + A*N^-alpha``, ``A*N^-alpha`` or ``none``."""
    status: str
    """``ok``, or why the fit is reduced or missing."""
    n_points: int
    """Runs used (each seed is one point)."""
    n_scales: int
    """Distinct scales among them."""
    n_min: float = math.nan
    """Smallest observed N."""
    n_max: float = math.nan
    """Largest observed N."""
    E: float = math.nan
    """Irreducible loss (0 for a pure power law)."""
    A: float = math.nan
    """Coefficient in raw parameter units."""
    alpha: float = math.nan
    """Exponent."""
    E_sd: float = math.nan
    """Standard error of E from the fit covariance."""
    A_sd: float = math.nan
    """Standard error of A (delta method)."""
    alpha_sd: float = math.nan
    """Standard error of alpha."""
    E_boot: tuple[float, float] = (math.nan, math.nan)
    """Percentile interval of E over seed-bootstrap refits."""
    alpha_boot: tuple[float, float] = (math.nan, math.nan)
    """Percentile interval of alpha over seed-bootstrap refits."""
    boot_fits: int = 0
    """Bootstrap refits that converged."""

    def predict(self, n: np.ndarray | float) -> np.ndarray:
        """The fitted metric at parameter counts ``n``."""
        return self.E + self.A * np.asarray(n, dtype=float) ** (-self.alpha)

    def to_dict(self) -> dict:
        """JSON-ready dict; NaN becomes None."""
        return json_ready(asdict(self))


@dataclass(frozen=True)
class ScalingReport:
    """Fits of every variant and the sizes where each variant's fit crosses the baseline's."""

    metric: str
    """Metric fitted."""
    baseline: str
    """Variant the crossings are measured against."""
    n_range: tuple[float, float]
    """Sizes searched for crossings."""
    fits: dict[str, ScalingFit] = field(default_factory=dict)
    """Per variant."""
    crossings: dict[str, list[float]] = field(default_factory=dict)
    """Per variant: sizes N in ``n_range`` where its fit equals the baseline's (empty: no crossing)."""

    def to_dict(self) -> dict:
        """JSON-ready dict; NaN becomes None."""
        return json_ready({
            "metric": self.metric, "baseline": self.baseline, "n_range": list(self.n_range),
            "fits": {v: f.to_dict() for v, f in self.fits.items()}, "crossings": self.crossings,
        })


def fit_variant(points: pd.DataFrame, variant: str, metric: str, n_boot: int = 200, seed: int = 0) -> ScalingFit:
    """Fit one variant's finished runs (columns scale, seed, params_counted and ``metric``)."""
    n_scales = points["scale"].nunique()
    base = dict(variant=variant, metric=metric, n_points=len(points), n_scales=n_scales)
    if n_scales < 2:
        return ScalingFit(form="none", status=f"not enough scales ({n_scales}; a fit needs 2)", **base)
    saturating = n_scales >= MIN_SCALES_SATURATING
    status = "ok" if saturating else f"pure power law: {n_scales} scales (E needs {MIN_SCALES_SATURATING})"
    n = points["params_counted"].to_numpy(float)
    loss = points[metric].to_numpy(float)
    log_ref = float(np.mean(np.log(n)))
    try:
        theta, cov = _fit(n, loss, log_ref, saturating)
    except (RuntimeError, ValueError) as exc:
        if not saturating:
            return ScalingFit(form="none", status=f"fit failed: {exc}", **base)
        saturating, status = False, f"saturating fit failed ({exc}); pure power law"
        theta, cov = _fit(n, loss, log_ref, saturating)
    E, b, alpha = theta
    sd = np.sqrt(np.clip(np.diag(cov), 0, None)) if np.all(np.isfinite(cov)) else np.full(3, math.nan)
    var_log_a = cov[1, 1] + log_ref**2 * cov[2, 2] + 2 * log_ref * cov[1, 2]
    A = math.exp(b + alpha * log_ref)
    boots = _bootstrap(points, metric, log_ref, saturating, theta, n_boot, seed)
    quantiles = [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2]
    E_boot = tuple(np.quantile(boots[:, 0], quantiles)) if len(boots) else (math.nan, math.nan)
    alpha_boot = tuple(np.quantile(boots[:, 2], quantiles)) if len(boots) else (math.nan, math.nan)
    return ScalingFit(
        form="E + A*N^-alpha" if saturating else "A*N^-alpha", status=status, n_min=float(n.min()),
        n_max=float(n.max()), E=float(E), A=A, alpha=float(alpha), E_sd=float(sd[0]),
        A_sd=A * math.sqrt(var_log_a) if np.isfinite(var_log_a) and var_log_a >= 0 else math.nan,
        alpha_sd=float(sd[2]), E_boot=tuple(map(float, E_boot)), alpha_boot=tuple(map(float, alpha_boot)),
        boot_fits=len(boots), **base,
    )


def scaling_report(
    df: pd.DataFrame, baseline: str, metric: str = "val/loss", n_range: tuple[float, float] | None = None,
    n_boot: int = 200, seed: int = 0,
) -> ScalingReport:
    """Fit every variant on its finished runs and find where each crosses the baseline within ``n_range``.

    The default range runs from the smallest observed size to ``EXTRAPOLATE`` times the largest.
    """
    usable = df[(df["status"] == FINISHED) & df[metric].notna() & df["params_counted"].notna()]
    fits = {v: fit_variant(g, v, metric, n_boot, seed) for v, g in usable.groupby("variant", sort=True)}
    if n_range is None:
        sizes = usable["params_counted"].to_numpy(float)
        n_range = (float(sizes.min()), float(sizes.max()) * EXTRAPOLATE) if len(sizes) else (math.nan, math.nan)
    crossings = {}
    if baseline in fits and fits[baseline].form != "none":
        for variant, fit in fits.items():
            if variant != baseline and fit.form != "none":
                crossings[variant] = crossing(fit, fits[baseline], n_range)
    return ScalingReport(metric, baseline, n_range, fits, crossings)


def crossing(a: ScalingFit, b: ScalingFit, n_range: tuple[float, float], grid: int = 512) -> list[float]:
    """Sizes in ``n_range`` where the two fitted curves are equal (two saturating power laws meet at most twice)."""
    from scipy.optimize import brentq

    lo, hi = n_range
    if not (np.isfinite(lo) and np.isfinite(hi) and 0 < lo < hi):
        return []

    def gap(n: float) -> float:
        return float(a.predict(n) - b.predict(n))

    sizes = np.geomspace(lo, hi, grid)
    values = a.predict(sizes) - b.predict(sizes)
    roots = []
    for i in np.flatnonzero(np.sign(values[:-1]) * np.sign(values[1:]) < 0):
        roots.append(float(brentq(gap, sizes[i], sizes[i + 1], rtol=1e-10)))
    return roots


def _model(log_ref: float, saturating: bool):
    """The curve in the centred form and its analytic Jacobian (several times faster than finite differences)."""

    def power(n, b, alpha):
        return np.exp(b - alpha * (np.log(n) - log_ref))

    def power_jac(n, b, alpha):
        term = power(n, b, alpha)
        return np.column_stack([term, -(np.log(n) - log_ref) * term])

    if not saturating:
        return power, power_jac
    return (lambda n, E, b, alpha: E + power(n, b, alpha),
            lambda n, E, b, alpha: np.column_stack([np.ones_like(n), power_jac(n, b, alpha)]))


def _fit(
    n: np.ndarray, loss: np.ndarray, log_ref: float, saturating: bool, start: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(E, b, alpha) and their 3x3 covariance; E is 0 with zero variance for the pure power law."""
    from scipy.optimize import curve_fit

    floor = float(loss.min())
    if saturating:
        E0 = 0.5 * floor if start is None else min(start[0], floor * 0.999)
        p0 = [E0, math.log(max(float(loss.mean()) - E0, 1e-6)), 0.3] if start is None else [E0, *start[1:]]
        # E must sit below every observed loss, or the power-law term would have to be negative.
        bounds = ([0.0, -50.0, 0.0], [floor, 50.0, 5.0])
    else:
        p0 = [math.log(float(loss.mean())), 0.3] if start is None else list(start[1:])
        bounds = ([-50.0, 0.0], [50.0, 5.0])
    p0 = np.clip(p0, bounds[0], np.nextafter(np.array(bounds[1]), -np.inf))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, jac = _model(log_ref, saturating)
        theta, cov = curve_fit(model, n, loss, p0=p0, bounds=bounds, jac=jac, maxfev=5000)
    if saturating:
        return theta, cov
    full = np.zeros((3, 3))
    full[1:, 1:] = cov
    return np.array([0.0, *theta]), full


def _bootstrap(
    points: pd.DataFrame, metric: str, log_ref: float, saturating: bool, theta: np.ndarray, n_boot: int, seed: int
) -> np.ndarray:
    """Refits on seeds resampled with replacement (a drawn seed brings its runs at every scale)."""
    seeds = np.sort(points["seed"].unique())
    if len(seeds) < 2 or n_boot <= 0:
        return np.empty((0, 3))
    columns = points[["params_counted", metric]].to_numpy(float)
    scale_codes = pd.factorize(points["scale"])[0]
    rows_of = [np.flatnonzero(points["seed"].to_numpy() == s) for s in seeds]
    needed = MIN_SCALES_SATURATING if saturating else 2
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_boot):
        rows = np.concatenate([rows_of[i] for i in rng.integers(0, len(seeds), size=len(seeds))])
        if len(np.unique(scale_codes[rows])) < needed:
            continue
        try:
            fitted, _ = _fit(columns[rows, 0], columns[rows, 1], log_ref, saturating, start=theta)
        except (RuntimeError, ValueError):
            continue
        out.append(fitted)
    return np.array(out).reshape(-1, 3)
