"""From a work profile to per-layer FFN widths under a fixed budget (study 2, steps 4-5).

Surrogate: layer l's error falls as w_l^(-a_l) and costs lambda_l c_l, c_l the smoothed work:

    minimise   sum_l lambda_l c_l w_l^(-a_l)   subject to   sum_l w_l = B,   w_l >= w_min.

Convex and separable, so KKT suffices: w_l = max(w_min, (a_l lambda_l c_l / mu)^(1 / (1 + a_l))), with the budget's
multiplier mu found by Brent's method on log mu (sum_l w_l is decreasing in it). The widths are real; `study.budget`
rounds them to the parameter budget. a_l = 2 / ID_l (TwoNN intrinsic dimension of the cloud entering the FFN: a
width-w network approximates a C^2 function on a d-manifold with error O(w^(-2/d))); `exponent="constant"` uses one a.

The schedule's `reverse` (the anti control) reflects the allocated widths, not the work: with x_l = w_l / u and bound
f, the excess e_l = x_l - f becomes r_l = f + s (max e + min e - e_l), s keeping the total. The order is exactly
reversed, the bound and budget hold; reflecting the work alone could keep the direction (exponents and sensitivities
stay as measured) or flatten it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from study.config.geometry import GEOMETRIES, SMOOTHING, STATISTICS, AllocationConfig, one_of
from study.errors import StudyError
from study.files import LARGEST, read_json

# Smoothness of the function an FFN approximates, in the error rate w^(-smoothness / intrinsic dimension).
SMOOTHNESS = 2.0


def smooth_profile(work, method: str = "gaussian", width: float = 1.0) -> np.ndarray:
    """Work smoothed over depth. Edges repeat the end layers so the first and last layers are not pulled to 0."""
    from scipy.ndimage import gaussian_filter1d, uniform_filter1d

    work = np.asarray(work, dtype=np.float64)
    one_of("smoothing", method, SMOOTHING)
    if method == "gaussian":
        return gaussian_filter1d(work, sigma=width, mode="nearest")
    if method == "moving":
        return uniform_filter1d(work, size=int(width), mode="nearest")
    return work.copy()


def reversed_profile(values) -> np.ndarray:
    """Values reflected about their midrange, v -> max v + min v - v: same range and spacing, opposite order (the
    `reverse` operator of study.plan.widths.reflect, on arrays)."""
    values = np.asarray(values, dtype=np.float64)
    return values.max() + values.min() - values


def reflect_allocation(fractions, w_min: float) -> np.ndarray:
    """Each layer's width above `w_min` reflected about its midrange and scaled to the same total (`reverse`)."""
    excess = np.asarray(fractions, dtype=np.float64) - w_min
    mirrored = reversed_profile(excess)
    if not mirrored.sum() > 0:  # every layer sits on its bound: there is no direction to reverse
        return excess + w_min
    return w_min + mirrored * (excess.sum() / mirrored.sum())


def allocate_widths(cost, budget: float, w_min: float, exponents, weights=None) -> np.ndarray:
    """Widths minimising sum_l weights_l cost_l w_l^(-exponents_l) with sum w = budget and w >= w_min."""
    c = np.asarray(cost, dtype=np.float64)
    n = c.size
    a = np.broadcast_to(np.asarray(exponents, dtype=np.float64), c.shape)
    lam = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if np.any(c < 0) or np.any(lam < 0) or np.any(a <= 0):
        raise ValueError("costs and weights must be non-negative and exponents positive")
    if n * w_min > budget * (1 + 1e-12):
        raise StudyError("w_min_fraction", f"{n} layers at the lower bound {w_min:g} already exceed the budget "
                         f"{budget:g}", "lower w_min_fraction below 1")
    k = a * lam * c
    if n == 1 or n * w_min >= budget:
        return np.full(n, budget / n)
    if not np.any(k > 0):
        raise StudyError("work", "every layer's measured work is zero", "profile a trained run, not an untouched one")
    active = k > 0
    log_k = np.log(k[active])

    def widths(log_mu: float) -> np.ndarray:
        w = np.full(n, w_min)
        w[active] = np.maximum(w_min, np.exp((log_k - log_mu) / (1.0 + a[active])))
        return w

    # At lo some layer alone would take the whole budget; at hi no layer exceeds the uniform width.
    lo = float(np.min(log_k - (1.0 + a[active]) * np.log(budget)))
    hi = float(np.max(log_k - (1.0 + a[active]) * np.log(budget / n)))
    from scipy.optimize import brentq

    log_mu = brentq(lambda t: widths(t).sum() - budget, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    return widths(log_mu)


def allocate_from_profile(profile: dict, uniform_width: float, cfg: AllocationConfig,
                          reverse: bool = False) -> list[float]:
    """Real-valued FFN widths, one per layer, spending the same total width as `uniform_width` in every layer;
    `reverse` (the geometry schedule's) reflects them against the allocation's direction (`reflect_allocation`)."""
    layers = int(profile["layers"])
    # c_l: the configured statistic under the configured geometry, smoothed
    cost = smooth_profile(profile["stats"][cfg.statistic][cfg.geometry], cfg.smoothing, cfg.smoothing_width)
    if cfg.exponent == "intrinsic":  # a_l = SMOOTHNESS / ID_l
        ids = np.asarray(profile.get("intrinsic_dim"), dtype=np.float64)
        if not np.all(np.isfinite(ids) & (ids > 0)):
            raise StudyError("intrinsic_dim", "the profile has a missing or non-positive intrinsic dimension",
                             "profile with more tokens, or use exponent=constant")
        exponents = SMOOTHNESS / ids
    else:
        exponents = np.full(layers, cfg.exponent_const)
    weights = None
    if cfg.weight_by_sensitivity:
        if profile.get("sensitivity") is None:
            raise StudyError("weight_by_sensitivity", "the profile has no perturbation sensitivity",
                             "profile again with measure_sensitivity=true, or set weight_by_sensitivity=false")
        # A layer whose scaling lowers the loss (noise, or negative curvature) gets no weight, so it sits at w_min.
        weights = np.maximum(np.asarray(profile["sensitivity"], dtype=np.float64), 0.0)
    # The work was measured on the reference at its uniform width u, so layer l's error is c_l (w / u)^(-a_l):
    # solve for the fractions x = w / u (budget L, bound w_min_fraction), which no choice of unit can change.
    fractions = allocate_widths(cost, float(layers), cfg.w_min_fraction, exponents, weights)
    if reverse:
        fractions = reflect_allocation(fractions, cfg.w_min_fraction)
    return (uniform_width * fractions).tolist()


def read_profile(path, layers: int | None = None) -> dict:
    """A profile.json written by `study profile`, checked (`check_profile`) for a model of `layers` layers."""
    try:
        profile = read_json(Path(path), "point at the profile.json that `study profile RUN_KEY` wrote, or "
                            f"{PROFILE_FIX}")
    except StudyError as err:  # the option that named it, beside the file
        raise StudyError("profile", f"the profile {err.field} {err.problem}", err.fix) from None
    check_profile(profile, str(path), layers)
    return profile


LEAST_DIM = 1 / math.log(sys.float_info.max)
"""The least intrinsic dimension a profile can hold: TwoNN's n / sum log(r2 / r1) over n points is at least 1 / the
largest log of a float64 ratio (1 / 709.8); a smaller one was not measured, and its exponent 2 / d stalls the solver."""
PROFILE_FIX = "profile the reference run again (`study profile RUN_KEY` rewrites its profile.json)"


def check_profile(profile, where: str, layers: int | None = None) -> None:
    """A damaged or hand-edited profile (NaN or negative work, a missing key, a list of the wrong length) refused
    naming the file and the field, before the allocator fails deep in scipy or spends the budget on a NaN."""
    if not isinstance(profile, dict):
        raise StudyError(where, f"is a JSON {type(profile).__name__}, not a profile", PROFILE_FIX)
    n = profile.get("layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise StudyError(f"{where}: layers", f"{n!r} is not a number of layers" if "layers" in profile
                         else "is missing", PROFILE_FIX)
    if layers is not None and n != layers:
        raise StudyError(f"{where}: layers", f"the profile has {n} layers, the model {layers}",
                         "profile a reference run with the same depth as the scheduled runs")
    stats = profile.get("stats")
    if not isinstance(stats, dict):
        raise StudyError(f"{where}: stats", "is missing" if stats is None else "is not a mapping", PROFILE_FIX)
    for statistic in STATISTICS:
        for geometry in GEOMETRIES:
            per = stats.get(statistic)
            _check_layers(per.get(geometry) if isinstance(per, dict) else None,
                          f"{where}: stats.{statistic}.{geometry}", n, lambda v: v is not None and v >= 0,
                          "a finite work >= 0")
    # a layer whose intrinsic dimension could not be estimated is written as null (the intrinsic exponent refuses it)
    if profile.get("intrinsic_dim") is not None:
        _check_layers(profile["intrinsic_dim"], f"{where}: intrinsic_dim", n, lambda v: v is None or v >= LEAST_DIM,
                      f"a dimension of at least {LEAST_DIM:.4f} or null")
    if profile.get("sensitivity") is not None:
        _check_layers(profile["sensitivity"], f"{where}: sensitivity", n, lambda v: v is not None, "a finite number")


def _check_layers(values, field: str, layers: int, allowed, what: str) -> None:
    """One value per layer, each a finite number or null that `allowed` takes (`what` says which)."""
    if not isinstance(values, list):
        raise StudyError(field, "is missing" if values is None else f"is a {type(values).__name__}, not a list of "
                         "one value per layer", PROFILE_FIX)
    if len(values) != layers:
        raise StudyError(field, f"has {len(values)} values for {layers} layers", PROFILE_FIX)
    for layer, v in enumerate(values):
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if number and math.isfinite(v) and abs(v) > LARGEST:  # sums and products of such overflow the solver
            raise StudyError(field, f"layer {layer} holds {v!r}, past the {LARGEST:g} no measured value comes near",
                             PROFILE_FIX)
        if not (v is None or number) or (number and not math.isfinite(v)) or not allowed(v):
            raise StudyError(field, f"layer {layer} holds {v!r}, not {what}", PROFILE_FIX)


def geometry_widths(profile: dict, uniform_width: float, n_layers: int, alloc: AllocationConfig,
                    reverse: bool = False) -> list[float]:
    """Real-valued per-layer widths with the total of `n_layers` uniform layers (the budget matcher rounds them)."""
    if int(profile["layers"]) != n_layers:
        raise StudyError("profile", f"the profile has {profile['layers']} layers, the model {n_layers}",
                         "profile a reference run with the same depth as the scheduled runs")
    return allocate_from_profile(profile, uniform_width, alloc, reverse)
