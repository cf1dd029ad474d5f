"""Loss-versus-size fits per variant, ``L(N) = E + A * N^(-alpha)`` (N counted parameters, or training compute), and
where two variants' fits cross: Besiroglu et al. (2024)'s Huber loss of log residuals from a grid of starts, in the
centred form ``E + exp(b - alpha (ln N - ln N_ref))``, with a seed-cluster bootstrap every variant shares draw by
draw (:func:`seed_draws`). Every fit first sorts its points (:func:`in_order`): seed noise leaves the Huber minimum
flat, and row order would pick its point. analysis/README.md ("Statistics") has the rest.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from analysis.paired import TAILS
from analysis.records import JsonRecord
from analysis.run_table import FINISHED

MIN_SCALES_SATURATING = 4
"""Distinct scales needed for the three-parameter law; fewer fall back to a pure power law."""

MIN_SCALES = 3
"""Distinct scales below which no law is fitted: two points always fit a two-parameter power law exactly."""

HUBER_DELTA = 1e-3
"""Huber threshold on log residuals (Besiroglu et al. 2024; Hoffmann et al. 2022)."""

EXTRAPOLATE = 100.0
"""Crossings are searched up to this multiple of the largest observed size unless a range is given."""


@dataclass(frozen=True)
class ScalingFit(JsonRecord):
    """One variant's fit of a final metric against a size N: counted parameters, or training compute."""

    variant: str
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
    n_max: float = math.nan
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
    log_ref: float = math.nan
    """ln N_ref of the centred form (the geometric mean of the observed sizes)."""
    boots: list[list[float]] = field(default_factory=list, repr=False)
    """(E, b, alpha) of every bootstrap draw in draw order, NaN where a draw could not be fitted (not recorded)."""
    size: str = "params_counted"
    """Column N is read from: ``params_counted``, or ``compute`` (training FLOPs, :mod:`analysis.compute`)."""
    UNRECORDED = ("boots",)

    def predict(self, n: np.ndarray | float) -> np.ndarray:
        """The fitted metric at parameter counts ``n``."""
        return self.E + self.A * np.asarray(n, dtype=float) ** (-self.alpha)

    def solve(self, loss: np.ndarray | float) -> np.ndarray:
        """The size at which the fit reaches ``loss``: infinite where ``loss`` is at or below E (never reached)."""
        loss = np.asarray(loss, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            n = ((loss - self.E) / self.A) ** (-1 / self.alpha)
        return np.where(loss > self.E, n, math.inf)

    def draws(self) -> list[ScalingFit | None]:
        """The fit of every bootstrap draw in draw order (None where that draw could not be fitted)."""
        return [ScalingFit(self.variant, self.metric, self.form, self.status, 0, 0, E=E,
                           A=math.exp(b + alpha * self.log_ref), alpha=alpha, log_ref=self.log_ref, size=self.size)
                if np.all(np.isfinite((E, b, alpha))) else None for E, b, alpha in self.boots]


@dataclass(frozen=True)
class Crossing:
    """Where a variant's fit meets the baseline's, with its seed-bootstrap uncertainty."""

    sizes: list[float]
    """Sizes N in the searched range where the point fits are equal (empty: none in range)."""
    low: float = math.nan
    """low and high: the percentile interval of the first crossing over the draws that cross."""
    high: float = math.nan
    share: float = math.nan
    """Share of bootstrap draws whose fits cross inside the range."""
    draws: int = 0
    """Bootstrap draws where both fits converged."""


@dataclass(frozen=True)
class Holdout:
    """The fit without the largest scale, asked to predict it."""

    scale: str
    """The scale held out."""
    predicted: float
    """The held-out fit's prediction at that scale's median N."""
    observed: float
    """Mean of the finished runs at that scale."""
    error: float
    """predicted - observed."""
    form: str
    """Form of the held-out fit."""


@dataclass(frozen=True)
class ScalingReport(JsonRecord):
    """Fits of every variant and the sizes where each variant's fit crosses the baseline's."""

    metric: str
    """Metric fitted."""
    baseline: str
    """Variant the crossings are measured against."""
    n_range: tuple[float, float]
    """Sizes searched for crossings."""
    fits: dict[str, ScalingFit] = field(default_factory=dict)
    """Per variant."""
    crossings: dict[str, Crossing] = field(default_factory=dict)
    """Per variant other than the baseline, when both have a fit."""
    holdouts: dict[str, Holdout | str] = field(default_factory=dict)
    """Per variant: how the fit without its largest scale predicted it, or why that check is not possible."""


def fit_variant(points: pd.DataFrame, variant: str, metric: str, n_boot: int = 200, seed: int = 0,
                size: str = "params_counted", start: Sequence[float] | None = None,
                draw_starts: Sequence[Sequence[float]] = ()) -> ScalingFit:
    """Fit one variant's finished runs (columns scale, seed, ``size`` and ``metric``) against N = ``size``; ``start``
    (E, b, alpha) replaces the grid of starts (the grid is the fallback), ``draw_starts`` row i starts draw i."""
    points = in_order(points, [size, "seed", metric])
    n_scales = points["scale"].nunique()
    base = dict(variant=variant, metric=metric, n_points=len(points), n_scales=n_scales, size=size)
    if n_scales < MIN_SCALES:
        return ScalingFit(form="none", status=f"no fit possible: {n_scales} scale(s), a fit needs {MIN_SCALES}",
                          **base)
    saturating = n_scales >= MIN_SCALES_SATURATING
    status = "ok" if saturating else f"pure power law: {n_scales} scales (E needs {MIN_SCALES_SATURATING})"
    n = points[size].to_numpy(float)
    loss = points[metric].to_numpy(float)
    log_ref = float(np.mean(np.log(n)))
    try:
        theta, cov = _fit(n, loss, log_ref, saturating, None if start is None else np.asarray(start, float))
    except RuntimeError:
        theta, cov = _fit(n, loss, log_ref, saturating)
    E, b, alpha = theta
    sd = np.sqrt(np.clip(np.diag(cov), 0, None)) if np.all(np.isfinite(cov)) else np.full(3, math.nan)
    var_log_a = cov[1, 1] + log_ref**2 * cov[2, 2] + 2 * log_ref * cov[1, 2]
    A = math.exp(b + alpha * log_ref)
    # the draws refit what the point fit fits: the pure power law no E (0 where its draw was fitted)
    free = slice(0 if saturating else 1, None)
    codes = pd.factorize(points["scale"])[0]
    needed = MIN_SCALES_SATURATING if saturating else MIN_SCALES
    boots = refit_draws(points, loss, power_sum([np.log(n) - log_ref], saturating), theta[free],
                        lambda floor: power_bounds(floor, 1, saturating),
                        lambda drawn: len(np.unique(codes[drawn])) >= needed, n_boot, seed,
                        [np.asarray(row, float)[free] for row in draw_starts])
    if not saturating:
        boots = np.column_stack([np.where(np.isfinite(boots[:, 0]), 0.0, math.nan), boots])
    finite = boots[np.all(np.isfinite(boots), axis=1)]
    E_boot, alpha_boot = np.quantile(finite[:, [0, 2]], TAILS, axis=0).T if len(finite) else np.full((2, 2), math.nan)
    return ScalingFit(
        form="E + A*N^-alpha" if saturating else "A*N^-alpha", status=status, n_min=float(n.min()),
        n_max=float(n.max()), E=float(E), A=A, alpha=float(alpha), E_sd=float(sd[0]),
        A_sd=A * math.sqrt(var_log_a) if np.isfinite(var_log_a) and var_log_a >= 0 else math.nan,
        alpha_sd=float(sd[2]), E_boot=tuple(map(float, E_boot)), alpha_boot=tuple(map(float, alpha_boot)),
        boot_fits=len(finite), log_ref=log_ref, boots=[list(map(float, row)) for row in boots], **base)


def scaling_report(df: pd.DataFrame, baseline: str, metric: str = "val/loss",
                   n_range: tuple[float, float] | None = None, n_boot: int = 200, seed: int = 0,
                   size: str = "params_counted") -> ScalingReport:
    """Fit every variant on its finished runs against N = ``size`` and find where each crosses the baseline within
    ``n_range`` (default: the smallest observed size to ``EXTRAPOLATE`` times the largest)."""
    usable = df[(df["status"] == FINISHED) & df[metric].notna() & df[size].notna()]
    fits = {v: fit_variant(g, v, metric, n_boot, seed, size) for v, g in usable.groupby("variant", sort=True)}
    if n_range is None:
        sizes = usable[size].to_numpy(float)
        n_range = (float(sizes.min()), float(sizes.max()) * EXTRAPOLATE) if len(sizes) else (math.nan, math.nan)
    crossings = {}
    if baseline in fits and fits[baseline].form != "none":
        for variant, fit in fits.items():
            if variant != baseline and fit.form != "none":
                crossings[variant] = _crossing_with_interval(fit, fits[baseline], n_range)
    holdouts = {v: holdout(g, v, metric, size) for v, g in usable.groupby("variant", sort=True)}
    return ScalingReport(metric, baseline, n_range, fits, crossings, holdouts)


def holdout(points: pd.DataFrame, variant: str, metric: str, size: str = "params_counted") -> Holdout | str:
    """Fit without the largest scale and compare its prediction there with the measured mean."""
    by_scale = points.groupby("scale")[size].median().sort_values()
    if len(by_scale) < MIN_SCALES + 1:
        return f"needs {MIN_SCALES + 1} scales ({len(by_scale)} finished)"
    largest = by_scale.index[-1]
    fit = fit_variant(points[points["scale"] != largest], variant, metric, n_boot=0, size=size)
    predicted = float(fit.predict(float(by_scale.iloc[-1])))
    observed = float(points.loc[points["scale"] == largest, metric].mean())
    return Holdout(str(largest), predicted, observed, predicted - observed, fit.form)


def _crossing_with_interval(a: ScalingFit, b: ScalingFit, n_range: tuple[float, float]) -> Crossing:
    sizes = crossing(a, b, n_range)
    pairs = [(x, y) for x, y in zip(a.draws(), b.draws()) if x is not None and y is not None]
    if not pairs:
        return Crossing(sizes)
    firsts = [found[0] for found in (crossing(x, y, n_range, grid=128) for x, y in pairs) if found]
    low, high = np.quantile(firsts, TAILS) if firsts else (math.nan, math.nan)
    return Crossing(sizes, float(low), float(high), len(firsts) / len(pairs), len(pairs))


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
    return [float(brentq(gap, sizes[i], sizes[i + 1], rtol=1e-10))
            for i in np.flatnonzero(np.sign(values[:-1]) * np.sign(values[1:]) < 0)]


def _fit(n: np.ndarray, loss: np.ndarray, log_ref: float, saturating: bool, start: np.ndarray | None = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """(E, b, alpha) from the grid of starts (or ``start`` alone) and their Gauss-Newton covariance of the log
    residuals; E is 0 with zero variance for the pure power law."""
    lower, upper = power_bounds(float(loss.min()), 1, saturating)
    if start is not None:
        starts = np.asarray([start if saturating else start[1:]], float)
    elif saturating:
        starts = power_starts(loss)
    else:
        starts = np.array([[math.log(float(loss.mean())), a] for a in (0.05, 0.1, 0.3, 0.6)])
    model = power_sum([np.log(n) - log_ref], saturating)
    best = huber_fit(model, np.log(loss), starts, lower, upper)
    if best is None:
        raise RuntimeError("no start converged")
    dof = max(len(n) - len(best.x), 1)
    # the model's own Jacobian: scipy's (best.jac) is scaled by the Huber weights, which zero every row past the
    # threshold, so with seed noise of a few percent J^T J was near singular and alpha's se came out at 5e5
    jac = model(best.x[None, :])[1][0]
    with np.errstate(all="ignore"):
        try:
            cov = np.linalg.inv(jac.T @ jac) * float(np.sum(best.fun**2) / dof)
        except np.linalg.LinAlgError:
            cov = np.full((len(best.x),) * 2, math.nan)
    if saturating:
        return best.x, cov
    full = np.zeros((3, 3))
    full[1:, 1:] = cov
    return np.array([0.0, *best.x]), full


def power_bounds(floor: float, terms: int = 1, saturating: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of :func:`power_sum`'s parameters, E (where ``saturating``) below the lowest loss fitted ``floor``, then
    each term's b in [-50, 50] and exponent in [0, 5]."""
    return (np.array([0.0] * saturating + [-50.0, 0.0] * terms),
            np.array([floor * (1 - 1e-9)] * saturating + [50.0, 5.0] * terms))


def power_starts(loss: np.ndarray, terms: int = 1) -> np.ndarray:
    """The grid of starts of a saturating :func:`power_sum`: E at three shares of the lowest loss, the terms sharing
    the rest of the mean loss equally, every combination of their exponents."""
    floor, mean = float(loss.min()), float(loss.mean())
    rows = []
    for e in (0.0, 0.5, 0.9):
        b = math.log(max(mean - e * floor, 1e-6) / terms)
        rows += [[e * floor, *(v for a in exponents for v in (b, a))]
                 for exponents in itertools.product((0.1, 0.3, 0.6), repeat=terms)]
    return np.array(rows)


OUTLIER_CURVATURE = 1e-2
"""Curvature the descent gives a residual past the Huber threshold (truly 0): with none, a draw whose few inliers
leave a direction flat stalls short of its minimum (1e-4 to 1e-2 all end at the same minimum)."""


def power_sum(xs: Sequence[np.ndarray], saturating: bool = True):
    """The log of ``E + sum_i exp(b_i - alpha_i x_i)`` (no E unless ``saturating``) and its Jacobian, each x_i a
    centred log size (ln N - ln N_ref): the model :func:`huber_descent` fits, parameters (E,) b_1, alpha_1, b_2, ..."""

    def model(th: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first = int(saturating)
        powers = [np.exp(th[:, first + 2 * i:first + 2 * i + 1] - th[:, first + 2 * i + 1:first + 2 * i + 2] * x)
                  for i, x in enumerate(xs)]
        total = th[:, 0:1] if saturating else 0.0
        for power in powers:
            total = total + power
        columns = [1.0 / total] if saturating else []
        for power, x in zip(powers, xs):
            share = power / total
            columns += [share, -x * share]
        return np.log(total), np.stack(columns, axis=2)

    return model


def huber_descent(model, log_loss: np.ndarray, weights: np.ndarray, starts: np.ndarray, lower: np.ndarray,
                  upper: np.ndarray, max_iter: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """Minimise the weighted Huber loss of log residuals for many problems at once: (parameters, cost) per row.

    Row d fits ``model(theta)[0][d] - log_loss`` with point weights ``weights[d]`` (a draw's multiplicities) from
    ``starts[d]`` within its bounds; ``model`` maps rows of parameters to (log fit at every point, Jacobian). Projected
    Levenberg-Marquardt on the Gauss-Newton model of the Huber loss, a step kept only when it lowers the row's cost,
    until it stalls (1e-10 relative move, 1e-15 relative gain) or its damping runs away; NaN where never finite.
    """
    delta, k = HUBER_DELTA, starts.shape[1]
    ceiling = np.nextafter(upper, -np.inf)
    theta = np.clip(np.asarray(starts, float), lower, ceiling)

    def evaluate(th: np.ndarray, w: np.ndarray):
        with np.errstate(all="ignore"):
            log_model, jac = model(th)
            r = log_model - log_loss
        far = np.abs(r)
        cost = np.sum(w * np.where(far <= delta, 0.5 * r * r, delta * far - 0.5 * delta * delta), axis=1)
        return r, jac, cost

    r, jac, cost = evaluate(theta, weights)
    damping = np.full(len(theta), 1e-3)
    active = np.isfinite(cost)
    eye = np.eye(k)
    for _ in range(max_iter):
        rows = np.flatnonzero(active)
        if not len(rows):
            break
        th, w, rr, J = theta[rows], weights[rows], r[rows], jac[rows]
        grad = np.einsum("dpk,dp->dk", J, w * np.clip(rr, -delta, delta))
        curvature = w * np.where(np.abs(rr) <= delta, 1.0, OUTLIER_CURVATURE)
        H = np.einsum("dpk,dp,dpl->dkl", J, curvature, J)
        held = ((th <= lower[rows]) & (grad > 0)) | ((th >= ceiling[rows]) & (grad < 0))
        system = H + (damping[rows, None] * np.maximum(np.einsum("dkk->dk", H), 1e-30))[:, :, None] * eye
        system = np.where(held[:, :, None] | held[:, None, :], 0.0, system) + eye * held[:, :, None]
        with np.errstate(all="ignore"):
            step = np.linalg.solve(system, np.where(held, 0.0, -grad)[:, :, None])[:, :, 0]
        new = np.clip(th + step, lower[rows], ceiling[rows])
        nr, njac, ncost = evaluate(new, w)
        old = cost[rows]
        kept = np.isfinite(ncost) & (ncost <= old) & np.all(np.isfinite(new), axis=1)
        moved = np.max(np.abs(new - th) / (np.abs(th) + 1e-8), axis=1)
        at = rows[kept]
        theta[at], r[at], jac[at], cost[at] = new[kept], nr[kept], njac[kept], ncost[kept]
        damping[rows] = np.where(kept, np.maximum(damping[rows] / 3, 1e-12), damping[rows] * 4)
        done = (kept & (old - ncost <= 1e-15 * old) & (moved < 1e-10)) | (damping[rows] > 1e12)
        active[rows[done]] = False
    theta[~np.isfinite(cost)] = math.nan
    return theta, cost


def huber_fit(model, log_loss: np.ndarray, starts: np.ndarray, lower: np.ndarray, upper: np.ndarray):
    """scipy's ``least_squares`` Huber fit of ``model`` (as :func:`huber_descent` takes it) from the first start whose
    fit is finite, None when none is; several starts are first descended together (one batched descent finds the
    best basin at one call's overhead) and tried from the lowest cost."""
    from scipy.optimize import least_squares

    ceiling = np.nextafter(upper, -np.inf)
    starts = np.clip(starts, lower, ceiling)
    if len(starts) > 1:
        ends, cost = huber_descent(model, log_loss, np.ones((len(starts), len(log_loss))), starts,
                                   np.tile(lower, (len(starts), 1)), np.tile(upper, (len(starts), 1)))
        finite = np.flatnonzero(np.isfinite(cost) & np.all(np.isfinite(ends), axis=1))
        # where no batched end is finite, scipy still tries the starts themselves
        starts = ends[finite[np.argsort(cost[finite], kind="stable")]] if len(finite) else starts
    for start in starts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = least_squares(lambda th: model(th[None, :])[0][0] - log_loss, np.clip(start, lower, ceiling),
                                jac=lambda th: model(th[None, :])[1][0], bounds=(lower, upper), loss="huber",
                                f_scale=HUBER_DELTA, x_scale="jac", max_nfev=2000)
        if np.all(np.isfinite(res.x)):
            return res
    return None


def refit_draws(points: pd.DataFrame, loss: np.ndarray, model, theta: np.ndarray, bounds, enough, n_boot: int,
                seed: int, draw_starts: Sequence[np.ndarray] = ()) -> np.ndarray:
    """Row i: ``model``'s parameters refitted on seed-bootstrap draw i of ``points`` (:func:`seed_draws`), NaN where
    the points drawn fail ``enough`` (a mask of them), so two fits' draws stay aligned; none below two seeds. Each
    distinct multiset of seeds (5 seeds: about 90 among 200 draws) is fitted once, as weighted points in one batched
    descent, from ``theta`` or row i of ``draw_starts`` for the draw i that first made it, within ``bounds`` of the
    lowest loss drawn."""
    if points["seed"].nunique() < 2 or n_boot <= 0:
        return np.empty((0, len(theta)))
    weights, which = seed_draws(points["seed"].to_numpy(), n_boot, seed)
    starts = np.tile(theta, (len(weights), 1))
    for j, i in enumerate(np.unique(which, return_index=True)[1]):  # the draw that first made each multiset
        if i < len(draw_starts) and np.all(np.isfinite(draw_starts[i])):
            starts[j] = draw_starts[i]
    fitted = np.full((len(weights), len(theta)), math.nan)
    ok = np.flatnonzero([enough(w > 0) for w in weights])
    if len(ok):
        floors = np.where(weights[ok] > 0, loss, np.inf).min(axis=1)
        lower, upper = map(np.array, zip(*(bounds(floor) for floor in floors)))
        fitted[ok] = huber_descent(model, np.log(loss), weights[ok], starts[ok], lower, upper)[0]
    return fitted[which]


def in_order(points: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """``points`` sorted by ``columns`` (size, seed, value): a fit sums them in one order whatever their order."""
    return points.sort_values(list(columns), kind="stable", ignore_index=True)


def seed_draws(point_seeds: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The seed-cluster bootstrap over points with seeds ``point_seeds``: (each point's weight in each distinct multiset
    of seeds, in the order first drawn; each draw's multiset). Fits drawn with the same ``seed`` over as many seeds
    draw the same seeds in draw i: a paired resample."""
    seeds = np.unique(point_seeds)
    rng = np.random.default_rng(seed)
    first: dict[tuple[int, ...], int] = {}
    which = np.empty(n_boot, int)
    for i in range(n_boot):
        draw = tuple(sorted(rng.integers(0, len(seeds), size=len(seeds)).tolist()))
        which[i] = first.setdefault(draw, len(first))
    seed_of = np.searchsorted(seeds, point_seeds)
    return np.array([np.bincount(m, minlength=len(seeds))[seed_of] for m in first], float), which
