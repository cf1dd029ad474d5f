"""``L(N, D) = E + A / N^alpha + B / D^beta`` per arm, fitted to the endpoints of an experiment's finished decay
branches (each seed a point, trunks never), and what the surfaces say at each scale's planned compute: the iso-FLOP
line, the compute-optimal N and D, and the effective-compute multiplier k against the baseline. With fewer than
:data:`MIN_SIZES` sizes each arm is fitted per scale as ``L(D) = E + B / D^beta``. The fits and their bootstrap are
:mod:`analysis.scaling`'s; compute is FLOPs, never tokens. analysis/README.md ("The L(N, D) surface") has the rules.
"""

from __future__ import annotations

import math
from functools import partial
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import pandas as pd

from analysis.compute import PERCENTILE, Multiplier, interval, interval_kind, training_compute
from analysis.records import JsonRecord
from analysis.run_table import FINISHED, scale_order
from analysis.scaling import huber_fit, in_order, power_bounds, power_starts, power_sum, refit_draws

SURFACE, TOKENS = "E + A/N^alpha + B/D^beta", "E + B/D^beta"
"""The two forms: the surface over (N, D), and the curve over D at one size."""

PARAMETERS = {SURFACE: ("E", "A", "alpha", "B", "beta"), TOKENS: ("E", "B", "beta")}
"""Each form's parameters, in the order a fit's draws hold them."""

_SIZES = {SURFACE: ("n", "d"), TOKENS: ("d",)}
"""The sizes each form has a power term of, in the order its parameters hold them."""

MIN_SIZES = 3
"""Distinct sizes (scales) a surface needs: two leave E, A and alpha underdetermined."""

SEARCH = 10.0
"""The iso-FLOP line is searched a decade beyond the sizes fitted each way: further out the surface is an
extrapolation its points do not hold (a reduced ladder's put an arm's optimum at 1.3 parameters)."""

FRONTIER, PLANNED = "frontier", "planned N"
"""Where a surface's multiplier is read: between the arms' frontiers (the minima along the iso-FLOP lines), or, where
either arm's minimum lies beyond the searched sizes, at the variant's planned N (Multiplier.read_at)."""

K_MAX = 1e6
"""A multiplier is searched between 1 / K_MAX and K_MAX; beyond, it is 0 or infinite (never)."""

_GRID = 129
"""Points of the coarse search along an iso-FLOP line, before the golden-section refinement."""

SMALLEST_STUDIED = 113_246_208
"""Counted parameters of the smallest scale the shipped comparisons are about (sweeps/scale/113M.yaml)."""

FAR_BELOW = 10.0
"""A study whose largest size is this many times below SMALLEST_STUDIED gets the report's caveat (a CPU ladder's
losses test the analysis, not the architectures)."""


@dataclass(frozen=True)
class SurfaceFit(JsonRecord):
    """One arm's fit of a final metric: the surface over (N, D), or the curve over D at one scale."""

    variant: str
    form: str
    """:data:`SURFACE`, :data:`TOKENS` or ``none``."""
    status: str
    """``ok``, or why there is no fit."""
    scale: str = ""
    """The scale of an L(D) fit; empty for a surface."""
    n_points: int = 0
    """Branch endpoints used (each seed's is one point)."""
    n_sizes: int = 0
    """Distinct scales among them."""
    n_distinct: int = 0
    """Distinct (N, D) among them."""
    seeds: int = 0
    """Seeds the bootstrap resamples."""
    E: float = math.nan
    """Irreducible loss (of this size, for an L(D) fit)."""
    A: float = math.nan
    """Coefficient of the parameter term (NaN for an L(D) fit)."""
    alpha: float = math.nan
    """Exponent of N (NaN for an L(D) fit)."""
    B: float = math.nan
    """Coefficient of the data term."""
    beta: float = math.nan
    """Exponent of D."""
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per parameter: its interval over the seed-bootstrap refits (``interval`` says which kind)."""
    interval: str = PERCENTILE
    """``95%`` (percentile interval) or ``range`` (fewer than BOOTSTRAP_MIN_N seeds)."""
    boot_fits: int = 0
    """Bootstrap draws that could be fitted."""
    n_range: tuple[float, float] = (math.nan, math.nan)
    """Smallest and largest N fitted."""
    d_range: tuple[float, float] = (math.nan, math.nan)
    """Smallest and largest D fitted."""
    boots: list[list[float]] = field(default_factory=list, repr=False)
    """The parameters (PARAMETERS order) of every bootstrap draw, NaN where unfitted (not recorded)."""
    UNRECORDED = ("boots",)

    def predict(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray:
        """The fitted metric at N = ``n`` (ignored by an L(D) fit) and D = ``d``."""
        return _loss(self.params(), np.asarray(n, float), np.asarray(d, float))

    def params(self) -> np.ndarray:
        """(E, A, alpha, B, beta), with A = alpha = 0 for an L(D) fit (no parameter term)."""
        if self.form == TOKENS:
            return np.array([self.E, 0.0, 0.0, self.B, self.beta])
        return np.array([self.E, self.A, self.alpha, self.B, self.beta])

    def draw_params(self) -> np.ndarray:
        """:meth:`params` of every bootstrap draw, one row each (NaN rows where a draw could not be fitted)."""
        rows = np.asarray(self.boots, float).reshape(len(self.boots), len(PARAMETERS.get(self.form, ())))
        if self.form == TOKENS:
            zeros = np.where(np.isfinite(rows[:, :1]), 0.0, math.nan)
            return np.column_stack([rows[:, 0], zeros, zeros, rows[:, 1], rows[:, 2]])
        return rows.reshape(len(rows), 5)


@dataclass(frozen=True)
class FlopsPerToken:
    """An arm's training FLOPs per token as a function of N: 6 N times the ratio its runs recorded at their sizes,
    interpolated in ln N between them and held at the end ratios beyond them."""

    log_n: tuple[float, ...]
    """ln N of the arm's sizes, ascending."""
    log_ratio: tuple[float, ...]
    """ln(F / 6N) at each of them (the median over the arm's runs there)."""

    def __call__(self, n: np.ndarray | float) -> np.ndarray:
        n = np.asarray(n, float)
        return 6.0 * n * np.exp(np.interp(np.log(n), self.log_n, self.log_ratio))


@dataclass(frozen=True)
class Optimum:
    """One arm at one scale's planned compute: the planned run and the compute-optimal point of its surface."""

    variant: str
    scale: str
    """Scale whose planned run sets the compute."""
    compute: float
    """Planned compute (FLOPs)."""
    planned_n: float
    """Counted parameters of the planned run."""
    planned_d: float
    """Training tokens of the planned run."""
    planned_loss: float
    """The surface at the planned (N, D)."""
    n_opt: float
    """Compute-optimal N (NaN where the minimum lies outside the searched range)."""
    d_opt: float
    """Compute-optimal D = compute / F(n_opt)."""
    loss_opt: float
    """The surface's minimum along the iso-FLOP line (NaN where it lies beyond the searched sizes)."""
    n_interval: tuple[float, float] = (math.nan, math.nan)
    """Interval of n_opt over the bootstrap draws."""
    d_interval: tuple[float, float] = (math.nan, math.nan)
    """Interval of d_opt over the bootstrap draws."""
    interval: str = PERCENTILE
    """``95%`` or ``range``."""


@dataclass(frozen=True)
class IsoFlop:
    """The fitted surface along one iso-FLOP line, for the figure."""

    variant: str
    scale: str
    """Scale whose planned compute the line holds."""
    compute: float
    """FLOPs along the line."""
    n: list[float]
    """Counted parameters along it."""
    loss: list[float]
    """The surface at (n, compute / F(n))."""


@dataclass(frozen=True)
class SurfaceReport(JsonRecord):
    """Every arm's fit over its branch endpoints, and what they say at the planned compute; its record holds no
    points and no bootstrap draws."""

    baseline: str
    """Arm the multipliers are measured against."""
    metric: str
    """Final metric fitted."""
    form: str
    """:data:`SURFACE` (three sizes or more) or :data:`TOKENS` (L(D) per arm and scale)."""
    source: str
    """How compute was counted (analysis.compute: FLOPs per token x tokens, or 6 N D)."""
    fallback: str = ""
    """Why 6 N D was taken; empty when it was not."""
    status: str = "ok"
    """``ok``, or why nothing was fitted."""
    why: str = ""
    """Why there is no surface, for an L(D) report."""
    caveat: str = ""
    """The report's sentence when every size fitted is far below the studied scales (:data:`FAR_BELOW`), else empty."""
    fits: list[SurfaceFit] = field(default_factory=list)
    """Per arm (per arm and scale for L(D))."""
    optima: list[Optimum] = field(default_factory=list)
    """Per arm with a surface and scale: the planned run and the compute-optimal point at its compute."""
    multipliers: list[Multiplier] = field(default_factory=list)
    """Per arm other than the baseline and scale: k at the arm's planned compute."""
    isoflops: list[IsoFlop] = field(default_factory=list)
    """Per arm with a surface and scale: the surface along the planned compute's iso-FLOP line."""
    points: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False)
    """The endpoints fitted: variant, scale, seed, at, n, d, compute and the metric (for the figures)."""
    UNRECORDED, EMPTY_AS_NONE = ("points",), ("fallback", "why", "caveat")

    def fit(self, variant: str, scale: str = "") -> SurfaceFit | None:
        """The fit of ``variant`` (at ``scale``, for L(D))."""
        return next((f for f in self.fits if (f.variant, f.scale) == (variant, scale)), None)

    def multiplier(self, variant: str, scale: str) -> Multiplier | None:
        """k of ``variant`` at ``scale``'s planned compute, if read."""
        return next((m for m in self.multipliers if (m.variant, m.scale) == (variant, scale)), None)


def surface_report(branches: pd.DataFrame, baseline: str, metric: str = "val/loss", n_boot: int = 200,
                   seed: int = 0) -> SurfaceReport:
    """Fit every arm's finished branch endpoints (:attr:`analysis.run_table.StudyRuns.branches`) and read the optima
    and multipliers against ``baseline`` at each scale's planned compute; ``n_boot`` and ``seed`` as the L(N) fits'."""
    compute, source, fallback = training_compute(branches)
    tokens = branches["tokens"].fillna(branches["max_steps"] * branches["global_batch"] * branches["seq_len"])
    frame = branches.assign(n=branches["params_counted"].astype(float), d=tokens, compute=compute)
    usable = frame[(frame["status"] == FINISHED) & frame[metric].notna() & frame["n"].notna()
                   & (frame["d"] > 0) & (frame["compute"] > 0)]
    points = usable[["variant", "scale", "seed", "at", "n", "d", "compute", metric]].reset_index(drop=True)
    base = dict(baseline=baseline, metric=metric, source=source, fallback=fallback, points=points,
                caveat=_caveat(points))
    sizes = points["scale"].nunique()
    if not len(points):
        return SurfaceReport(form="none", status="no finished branch logged "
                             f"{metric} with its counted parameters and tokens", **base)
    order = scale_order(usable)
    planned = _planned(points)
    if sizes >= MIN_SIZES:
        fits = [fit_surface(g, v, metric, n_boot, seed) for v, g in points.groupby("variant", sort=True)]
        return _surface_readings(SurfaceReport(form=SURFACE, fits=fits, **base), planned, order)
    why = (f"the branches cover {sizes} size{'s' if sizes > 1 else ''} ({', '.join(order)}): a surface over N and D "
           f"needs {MIN_SIZES}, " + ("since one N says nothing about how loss falls with N" if sizes == 1 else
                                      "since at two sizes E, A and alpha meet the data only through the two values "
                                      "E + A N^-alpha"))
    fits = [fit_surface(g, v, metric, n_boot, seed, TOKENS, s)
            for (v, s), g in points.groupby(["variant", "scale"], sort=True)]
    report = SurfaceReport(form=TOKENS, why=why, fits=fits, **base)
    return _tokens_readings(report, planned, order)


def _caveat(points: pd.DataFrame) -> str:
    """The report's sentence for sizes far below the studied scales (FAR_BELOW), else ""."""
    if not len(points) or points["n"].max() * FAR_BELOW > SMALLEST_STUDIED:
        return ""
    low, high = points["n"].min(), points["n"].max()
    per_param = points["d"] / points["at"] / points["n"]  # the planned runs' tokens per parameter
    return (f"Every size fitted here ({low:,.0f} to {high:,.0f} counted parameters, {points['d'].max():,.0f} training "
            f"tokens at most) is over {FAR_BELOW:g} times below the smallest scale the studies compare "
            f"({SMALLEST_STUDIED:,} parameters, 113M): these fits, optima and multipliers check the analysis on "
            "trained runs and real seed noise; they say nothing about the architectures at 113M or above, where "
            f"the losses, the data and the LR's transfer differ. The planned runs train on {per_param.min():.2g} to "
            f"{per_param.max():.2g} tokens per parameter (a compute-optimal run on about 20, Hoffmann et al. 2022).")


def frontier(params: np.ndarray, flops: FlopsPerToken, compute: np.ndarray | float, n_bounds: tuple[float, float]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N, D, loss) at the minimum of surface row i of ``params`` along the iso-FLOP line of ``compute[i]``, N within
    ``n_bounds`` (a grid in ln N, then golden-section search); N and D are NaN where the minimum lies beyond."""
    params = np.atleast_2d(np.asarray(params, float))
    rows = np.broadcast_shapes((len(params),), np.shape(compute))
    params, compute = np.broadcast_to(params, rows + (5,)), np.broadcast_to(np.asarray(compute, float), rows)
    lo, hi = np.log(n_bounds[0]), np.log(n_bounds[1])

    def along(x: np.ndarray) -> np.ndarray:  # x: ln N, one row per surface
        n = np.exp(x)
        return _loss(params[:, None, :], n, compute[:, None] / flops(n))

    grid = np.linspace(lo, hi, _GRID)
    with np.errstate(all="ignore"):
        values = along(np.broadcast_to(grid, (len(compute), _GRID)))
    best = np.argmin(np.where(np.isfinite(values), values, np.inf), axis=1)
    edge = (best == 0) | (best == _GRID - 1)
    i = np.clip(best, 1, _GRID - 2)
    a, b = grid[i - 1], grid[i + 1]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    with np.errstate(all="ignore"):
        fc, fd = along(c[:, None])[:, 0], along(d[:, None])[:, 0]
        for _ in range(70):  # golden section: the bracket of two grid cells shrinks 0.618x a step, to below 1e-15
            left = fc < fd  # the minimum lies in [a, d]: d becomes c's old point; else in [c, b]
            a, b = np.where(left, a, c), np.where(left, d, b)
            c, d, kept = (np.where(left, b - ratio * (b - a), d), np.where(left, c, a + ratio * (b - a)),
                          np.where(left, fc, fd))
            new = along(np.where(left, c, d)[:, None])[:, 0]
            fc, fd = np.where(left, new, kept), np.where(left, kept, new)
        x = (a + b) / 2
        loss = along(x[:, None])[:, 0]
    inside = ~edge & np.isfinite(loss)
    n = np.where(inside, np.exp(x), math.nan)
    return n, np.where(inside, compute / flops(np.exp(x)), math.nan), loss


def compute_to_reach(params: np.ndarray, flops: FlopsPerToken, loss: np.ndarray, near: np.ndarray,
                     n_bounds: tuple[float, float]) -> np.ndarray:
    """The compute at which each surface's frontier comes down to ``loss``, searched in ln C within K_MAX of ``near``
    (Illinois regula falsi: the frontier is smooth and monotone in ln C); inf where it never does, 0 where it is
    below already at the low end."""
    params = np.atleast_2d(np.asarray(params, float))
    loss, near = np.asarray(loss, float), np.asarray(near, float)

    def gap(u: np.ndarray) -> np.ndarray:
        return frontier(params, flops, np.exp(u), n_bounds)[2] - loss

    a, b = np.log(near) - math.log(K_MAX), np.log(near) + math.log(K_MAX)
    fa, fb = gap(a), gap(b)
    never = (loss <= params[:, 0]) | ~(fb < 0)
    already = ~never & ~(fa > 0)
    for _ in range(100):
        open_ = ~never & ~already & (np.abs(b - a) > 1e-12 * np.maximum(np.abs(b), 1.0)) & (fb != 0)
        if not open_.any():
            break
        with np.errstate(all="ignore"):
            u = b - fb * (b - a) / (fb - fa)
        u = np.where(open_ & np.isfinite(u), u, b)
        fu = np.where(open_, gap(u), fb)
        crossed = open_ & (fu * fb < 0)
        a, fa = np.where(crossed, b, a), np.where(crossed, fb, np.where(open_, fa / 2, fa))
        b, fb = np.where(open_, u, b), np.where(open_, fu, fb)
    return np.where(never, math.inf, np.where(already, 0.0, np.exp(b)))


def flops_rule(points: pd.DataFrame) -> FlopsPerToken:
    """An arm's FLOPs per token as a function of N from its endpoints (columns n, d, compute)."""
    ratio = (points["compute"] / (6.0 * points["n"] * points["d"])).groupby(points["n"]).median().sort_index()
    return FlopsPerToken(tuple(np.log(ratio.index.to_numpy(float))), tuple(np.log(ratio.to_numpy(float))))


def _loss(params: np.ndarray, n: np.ndarray, d: np.ndarray) -> np.ndarray:
    E, A, alpha, B, beta = (params[..., k] for k in range(5))
    with np.errstate(divide="ignore", over="ignore"):
        return E + A * n ** (-alpha) + B * d ** (-beta)


def _planned(points: pd.DataFrame) -> pd.DataFrame:
    """Per (variant, scale): the planned run's N, D and compute (medians over the arm's branches there)."""
    frame = points.assign(planned_d=points["d"] / points["at"], planned_c=points["compute"] / points["at"])
    return frame.groupby(["variant", "scale"])[["n", "planned_d", "planned_c"]].median()


def _codes(points: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per point, a code of its size and of its (N, D): a scale is a size, and its branches at one point share D."""
    return pd.factorize(points["scale"])[0], points.groupby(["scale", "d"], sort=False).ngroup().to_numpy()


def _counts(codes: tuple[np.ndarray, np.ndarray], chosen: np.ndarray | slice = slice(None)) -> tuple[int, int]:
    """(distinct sizes, distinct (N, D)) among the ``chosen`` points."""
    return len(np.unique(codes[0][chosen])), len(np.unique(codes[1][chosen]))


def _enough(form: str, sizes: int, distinct: int) -> str:
    """Why ``form`` cannot be fitted to that many sizes and distinct points; empty when it can."""
    needed = len(PARAMETERS[form])
    if distinct < needed:
        what = "(N, D)" if form == SURFACE else "token counts D"
        return f"no fit: {distinct} distinct {what} for {needed} parameters"
    if form == SURFACE and sizes < MIN_SIZES:
        return f"no fit: {sizes} sizes, a surface needs {MIN_SIZES}"
    return ""


def fit_surface(points: pd.DataFrame, variant: str, metric: str = "val/loss", n_boot: int = 200, seed: int = 0,
                form: str = SURFACE, scale: str = "") -> SurfaceFit:
    """One arm's L(N, D) from its endpoints (columns scale, seed, n, d and ``metric``), or with ``form`` :data:`TOKENS`
    its L(D) at ``scale``; the points are put in one order first (:func:`analysis.scaling.in_order`)."""
    points = in_order(points, ["n", "d", "seed", metric])
    sizes, distinct = _counts(_codes(points))
    seeds = points["seed"].nunique()
    base = dict(variant=variant, scale=scale, n_points=len(points), n_sizes=sizes, n_distinct=distinct, seeds=seeds)
    why = _enough(form, sizes, distinct)
    if why:
        return SurfaceFit(form="none", status=why, **base)
    n, d = points["n"].to_numpy(float), points["d"].to_numpy(float)
    log_loss = np.log(points[metric].to_numpy(float))
    logs = [np.log(points[column].to_numpy(float)) for column in _SIZES[form]]
    refs = [float(np.mean(x)) for x in logs]
    model = power_sum([x - ref for x, ref in zip(logs, refs)])
    best = huber_fit(model, log_loss, power_starts(points[metric].to_numpy(float), len(refs)),
                     *power_bounds(float(np.exp(log_loss).min()), len(refs)))
    if best is None:
        return SurfaceFit(form="none", status="no fit: no start converged", **base)
    theta = best.x
    boots = _bootstrap(points, form, metric, model, refs, theta, n_boot, seed)
    point = _uncentred(theta, refs)
    kind = interval_kind(seeds)
    finite = boots[np.all(np.isfinite(boots), axis=1)]
    intervals = {name: interval(finite[:, k], point[k], kind) for k, name in enumerate(PARAMETERS[form])}
    status = "ok" if distinct > len(theta) else (
        f"ok, exactly determined: {distinct} distinct points for {len(theta)} parameters, so the fit cannot show "
        "its own misfit")
    return SurfaceFit(form=form, status=status, **dict(zip(PARAMETERS[form], map(float, point))),
                      intervals=intervals, interval=kind, boot_fits=len(finite),
                      n_range=(float(n.min()), float(n.max())), d_range=(float(d.min()), float(d.max())),
                      boots=[list(map(float, row)) for row in boots], **base)


def _uncentred(theta: Sequence[float], refs: Sequence[float]) -> np.ndarray:
    """PARAMETERS from the centred ones (E, then each term's b and exponent): A = exp(a + alpha ln N_ref), B = exp(b +
    beta ln D_ref)."""
    E, *terms = theta
    return np.array([E, *(v for b, a, ref in zip(terms[::2], terms[1::2], refs) for v in (math.exp(b + a * ref), a))])


def _bootstrap(points: pd.DataFrame, form: str, metric: str, model, refs: Sequence[float], theta: np.ndarray,
               n_boot: int, seed: int) -> np.ndarray:
    """Row i: the parameters refitted on analysis.scaling's bootstrap draw i from the point fit
    (:func:`analysis.scaling.refit_draws`), NaN where the drawn seeds leave too few points."""
    codes = _codes(points)
    centred = refit_draws(points, points[metric].to_numpy(float), model, theta,
                          lambda floor: power_bounds(floor, len(refs)),
                          lambda drawn: not _enough(form, *_counts(codes, drawn)), n_boot, seed)
    return np.array([_uncentred(row, refs) if np.all(np.isfinite(row)) else np.full(len(theta), math.nan)
                     for row in centred]).reshape(len(centred), len(theta))


def _surface_readings(report: SurfaceReport, planned: pd.DataFrame, order: list[str]) -> SurfaceReport:
    """The optima, iso-FLOP lines and multipliers of a surface report at each scale's planned compute."""
    fitted = {f.variant: f for f in report.fits if f.form == SURFACE}
    rules = {v: flops_rule(g) for v, g in report.points.groupby("variant")}
    bounds = {v: (f.n_range[0] / SEARCH, f.n_range[1] * SEARCH) for v, f in fitted.items()}
    reference = fitted.get(report.baseline)
    optima, isoflops, multipliers = [], [], []
    for variant, fit in fitted.items():
        scales = [s for s in order if (variant, s) in planned.index]
        compute = np.array([planned.loc[(variant, s), "planned_c"] for s in scales])
        n_opt, d_opt, loss_opt = frontier(fit.params(), rules[variant], compute, bounds[variant])
        draws = fit.draw_params()
        finite = draws[np.all(np.isfinite(draws), axis=1)]
        drawn_n, drawn_d, _ = frontier(np.repeat(finite, len(scales), axis=0), rules[variant],
                                       np.tile(compute, len(finite)), bounds[variant])
        drawn_n, drawn_d = drawn_n.reshape(len(finite), len(scales)), drawn_d.reshape(len(finite), len(scales))
        for k, scale in enumerate(scales):
            n_plan, d_plan = planned.loc[(variant, scale), ["n", "planned_d"]]
            optima.append(Optimum(variant, scale, float(compute[k]), float(n_plan), float(d_plan),
                                  float(fit.predict(n_plan, d_plan)), float(n_opt[k]), float(d_opt[k]),
                                  float(loss_opt[k]) if math.isfinite(n_opt[k]) else math.nan,
                                  interval(drawn_n[:, k], n_opt[k], fit.interval),
                                  interval(drawn_d[:, k], d_opt[k], fit.interval), fit.interval))
            ends = [n_plan, n_opt[k]] if math.isfinite(n_opt[k]) else [n_plan]
            line = np.geomspace(min(ends) / 10, max(ends) * 10, 64)  # the planned run and the optimum, and around
            isoflops.append(IsoFlop(variant, scale, float(compute[k]), line.tolist(),
                                    fit.predict(line, compute[k] / rules[variant](line)).tolist()))
        if reference is not None and variant != report.baseline:
            # a frontier whose minimum lies beyond the searched sizes is the surface at the search's edge, not an
            # optimum: there k is read at the variant's planned N instead
            theirs = frontier(reference.params(), rules[report.baseline], compute, bounds[report.baseline])[0]
            inside = np.isfinite(n_opt) & np.isfinite(theirs)
            plan = planned.loc[[(variant, s) for s in scales]]
            for where, chosen in ((FRONTIER, inside), (PLANNED, ~inside)):
                if not chosen.any():
                    continue
                sizes = plan["n"].to_numpy(float)[chosen]
                # between the frontiers: the baseline's compute to reach the variant's best loss at each compute
                read = (partial(_k_at_size, sizes=sizes, tokens=plan["planned_d"].to_numpy(float)[chosen],
                                flops=rules[report.baseline](sizes)) if where == PLANNED
                        else lambda mine, theirs, c, v=variant: compute_to_reach(
                            theirs, rules[report.baseline], frontier(mine, rules[v], c, bounds[v])[2], c,
                            bounds[report.baseline]) / c)
                multipliers += _multipliers(variant, [s for s, c in zip(scales, chosen) if c], compute[chosen],
                                            fit, reference, read, where)
            multipliers.sort(key=lambda m: (m.variant, order.index(m.scale)))
    return replace(report, optima=optima, isoflops=isoflops, multipliers=multipliers)


def _tokens_readings(report: SurfaceReport, planned: pd.DataFrame, order: list[str]) -> SurfaceReport:
    """The multipliers of an L(D) report: at each scale, at the arms' planned sizes."""
    points = report.points
    multipliers = []
    for scale in order:
        reference = report.fit(report.baseline, scale)
        if reference is None or reference.form == "none":
            continue
        at_scale = points[points["scale"] == scale]
        flops = (at_scale["compute"] / at_scale["d"]).groupby(at_scale["variant"]).median()
        for fit in report.fits:
            if fit.scale != scale or fit.variant == report.baseline or fit.form == "none":
                continue
            compute, tokens = planned.loc[(fit.variant, scale), ["planned_c", "planned_d"]]
            # an L(D) curve has no parameter term (A = 0): the size it is read at does not enter
            read = partial(_k_at_size, sizes=np.ones(1), tokens=np.array([tokens]),
                           flops=np.array([flops[report.baseline]]))
            multipliers += _multipliers(fit.variant, [scale], np.array([compute]), fit, reference, read)
    return replace(report, multipliers=multipliers)


def _k_at_size(mine: np.ndarray, theirs: np.ndarray, compute: np.ndarray, sizes: np.ndarray, tokens: np.ndarray,
               flops: np.ndarray) -> np.ndarray:
    """k per row at one size per scale: the baseline's FLOPs at N = ``sizes`` to reach the variant's fitted loss at
    ``sizes`` and ``tokens``, over the variant's planned ``compute``; rows repeat the scales once per draw."""
    reps = len(compute) // len(sizes)
    n, d, f = np.tile(sizes, reps), np.tile(tokens, reps), np.tile(flops, reps)
    target = _loss(mine, n, d)
    E, A, alpha, B, beta = (theirs[:, k] for k in range(5))
    with np.errstate(all="ignore"):
        floor = E + A * n ** -alpha
        needed = np.where(target > floor, ((target - floor) / B) ** (-1 / beta), math.inf)
    return f * needed / compute


def _multipliers(variant: str, scales: list[str], compute: np.ndarray, fit: SurfaceFit, reference: SurfaceFit,
                 read, read_at: str = "") -> list[Multiplier]:
    """One Multiplier per scale: k = ``read(variant's parameters, baseline's, compute)`` from the point fits, its
    interval from the paired draws by analysis.compute's rule; ``read_at`` says where (FRONTIER, PLANNED)."""
    k_point = read(np.tile(fit.params(), (len(scales), 1)), np.tile(reference.params(), (len(scales), 1)), compute)
    mine, theirs = fit.draw_params(), reference.draw_params()
    draws = min(len(mine), len(theirs))  # none when either arm has one seed
    mine, theirs = mine[:draws], theirs[:draws]
    both = np.all(np.isfinite(mine), axis=1) & np.all(np.isfinite(theirs), axis=1)
    pairs = int(both.sum())
    drawn = (read(np.repeat(mine[both], len(scales), axis=0), np.repeat(theirs[both], len(scales), axis=0),
                  np.tile(compute, pairs)).reshape(pairs, len(scales)) if pairs else np.empty((0, len(scales))))
    seeds = min(fit.seeds, reference.seeds)
    kind = interval_kind(seeds)
    return [Multiplier(variant, scale, float(c), float(k), *interval(drawn[:, i], float(k), kind), pairs,
                       interval=kind, seeds=seeds, read_at=read_at)
            for i, (scale, c, k) in enumerate(zip(scales, compute, k_point))]
