"""From a work profile to per-layer FFN widths under a fixed budget (study 2, steps 4-5).

Surrogate: layer l's approximation error falls as w_l^(-a_l) and costs lambda_l c_l, with c_l the smoothed work:

    minimise   sum_l lambda_l c_l w_l^(-a_l)   subject to   sum_l w_l = B,   w_l >= w_min.

The objective is convex and separable, so the KKT conditions are sufficient: with multiplier mu on the budget,

    w_l = max(w_min, (a_l lambda_l c_l / mu)^(1 / (1 + a_l))),

sum_l w_l is continuous and decreasing in mu, and the one mu meeting the budget is found by Brent's method on
log mu. Every layer above its bound then has the same marginal gain a_l lambda_l c_l w_l^(-a_l - 1) = mu. The
widths are real numbers: `study.budget` rounds them and meets the parameter budget exactly.

Exponents. a_l = 2 / ID_l, ID_l the TwoNN intrinsic dimension of the cloud entering layer l's FFN: a width-w
network approximates a C^2 function on a d-dimensional manifold with error O(w^(-2/d)) (free-knot piecewise-linear
rates), so the error exponent is smoothness over dimension with smoothness 2. `exponent="constant"` uses one a for
all layers instead, which makes w_l proportional to (lambda_l c_l)^(1 / (1 + a)) away from the bound.

The anti control reflects the smoothed work about its midrange, c_l -> max(c) + min(c) - c_l: the busiest layer
gets the least work and the reverse, while the profile keeps its range, its spacing and so its dynamic range
(1 / c_l would also reverse the order but blow up near-idle layers and compress busy ones). Exponents and
sensitivities are kept as measured, so only the direction of the work is reversed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from study.errors import StudyError
from study.geometry.geometries import GEOMETRIES, check_radius

STATISTICS = ("shift", "gw", "topo")
SMOOTHING = ("gaussian", "moving", "none")
EXPONENTS = ("intrinsic", "constant")
# Smoothness of the function an FFN approximates, in the error rate w^(-smoothness / intrinsic dimension).
SMOOTHNESS = 2.0


@dataclass
class AllocationConfig:
    """How the geometry stage measures a reference run and turns its profile into widths."""

    statistic: str = "topo"
    """Work statistic the widths follow: shift, gw (Gromov-Wasserstein) or topo (H1 diagram W2)."""
    geometry: str = "hyperbolic"
    """Geometry the statistic is measured in: raw, spherical or hyperbolic."""
    smoothing: str = "gaussian"
    """How the per-layer work is smoothed over depth: gaussian, moving (average) or none."""
    smoothing_width: float = 1.0
    """Gaussian sigma in layers, or the moving-average window in layers (an odd integer)."""
    exponent: str = "intrinsic"
    """Error exponent a_l: intrinsic (2 / TwoNN intrinsic dimension of the layer's input) or constant."""
    exponent_const: float = 1.0
    """a for every layer when exponent is constant."""
    w_min_fraction: float = 0.25
    """Lower bound of every layer's width, as a fraction of the uniform width."""
    anti: bool = False
    """Allocate against the measured direction: work reflected about its midrange (the anti control)."""
    weight_by_sensitivity: bool = False
    """Weight layer l by its measured perturbation sensitivity lambda_l (else lambda_l = 1)."""
    measure_sensitivity: bool = True
    """Measure perturbation sensitivity when profiling (2 L + 1 extra passes over the profiling batches)."""
    sensitivity_eps: float = 0.1
    """Relative scaling of the FFN branch, 1 +- eps, used to measure sensitivity."""
    hyperbolic_radius: float = 0.9
    """Radius in the Poincare ball at which unit-normalised states are placed (hyperbolic geometry)."""
    n_tokens: int = 1024
    """Tokens sampled from the validation batches to form each layer's cloud."""
    seed: int = 0
    """Seed of the token sample (the same positions are used in every layer)."""
    min_position: int = 1
    """First sequence position eligible: position 0 is an attention sink with outsized norm, the same state in
    every sequence that starts with the same token, and would dominate raw distances."""
    diagram_workers: int = -1
    """Processes computing the persistence-diagram distances: -1 one per available core, 1 inline (no processes).
    Workers are spawned, so a script that profiles needs the usual `if __name__ == "__main__":` guard."""

    def __post_init__(self) -> None:
        _one_of("statistic", self.statistic, STATISTICS)
        _one_of("geometry", self.geometry, GEOMETRIES)
        _one_of("smoothing", self.smoothing, SMOOTHING)
        _one_of("exponent", self.exponent, EXPONENTS)
        check_radius(self.hyperbolic_radius)
        if self.smoothing == "moving" and (self.smoothing_width < 1 or self.smoothing_width % 2 != 1):
            raise StudyError("smoothing_width", f"{self.smoothing_width} is not an odd window", "use 1, 3, 5, ...")
        if self.smoothing == "gaussian" and self.smoothing_width <= 0:
            raise StudyError("smoothing_width", "a Gaussian needs a positive sigma", "use e.g. 1.0, or smoothing=none")
        if self.exponent == "constant" and self.exponent_const <= 0:
            raise StudyError("exponent_const", "the error exponent must be positive", "use e.g. 1.0")
        if not 0.0 < self.w_min_fraction <= 1.0:
            raise StudyError("w_min_fraction", f"{self.w_min_fraction} is outside (0, 1]", "use e.g. 0.25")
        if self.n_tokens < 8:
            raise StudyError("n_tokens", f"{self.n_tokens} tokens are too few for a cloud", "use e.g. 1024")
        if self.diagram_workers == 0 or self.diagram_workers < -1:
            raise StudyError("diagram_workers", f"{self.diagram_workers} processes", "use -1 (all cores), 1 or more")


def _one_of(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise StudyError(field, f"unknown value {value!r}", f"use one of {', '.join(allowed)}")


def smooth_profile(work, method: str = "gaussian", width: float = 1.0) -> np.ndarray:
    """Work smoothed over depth. Edges repeat the end layers so the first and last layers are not pulled to 0."""
    from scipy.ndimage import gaussian_filter1d, uniform_filter1d

    work = np.asarray(work, dtype=np.float64)
    _one_of("smoothing", method, SMOOTHING)
    if method == "gaussian":
        return gaussian_filter1d(work, sigma=width, mode="nearest")
    if method == "moving":
        return uniform_filter1d(work, size=int(width), mode="nearest")
    return work.copy()


def anti_profile(work) -> np.ndarray:
    """The work reflected about its midrange: same range and spacing, opposite order."""
    work = np.asarray(work, dtype=np.float64)
    return work.max() + work.min() - work


def intrinsic_exponents(intrinsic_dim) -> np.ndarray:
    """a_l = SMOOTHNESS / ID_l."""
    ids = np.asarray(intrinsic_dim, dtype=np.float64)
    if not np.all(np.isfinite(ids) & (ids > 0)):
        raise StudyError(
            "intrinsic_dim",
            "the profile has a missing or non-positive intrinsic dimension",
            "profile with more tokens, or use exponent=constant",
        )
    return SMOOTHNESS / ids


def allocate_widths(cost, budget: float, w_min: float, exponents, weights=None) -> np.ndarray:
    """Widths minimising sum_l weights_l cost_l w_l^(-exponents_l) with sum w = budget and w >= w_min."""
    c = np.asarray(cost, dtype=np.float64)
    n = c.size
    a = np.broadcast_to(np.asarray(exponents, dtype=np.float64), c.shape)
    lam = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if np.any(c < 0) or np.any(lam < 0) or np.any(a <= 0):
        raise ValueError("costs and weights must be non-negative and exponents positive")
    if n * w_min > budget * (1 + 1e-12):
        raise StudyError(
            "w_min_fraction",
            f"{n} layers at the lower bound {w_min:g} already exceed the budget {budget:g}",
            "lower w_min_fraction below 1",
        )
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


def profile_cost(profile: dict, cfg: AllocationConfig) -> np.ndarray:
    """c_l for the configured statistic and geometry: smoothed, reflected for the anti control."""
    work = np.asarray(profile["stats"][cfg.statistic][cfg.geometry], dtype=np.float64)
    cost = smooth_profile(work, cfg.smoothing, cfg.smoothing_width)
    return anti_profile(cost) if cfg.anti else cost


def allocate_from_profile(profile: dict, uniform_width: float, cfg: AllocationConfig) -> list[float]:
    """Real-valued FFN widths, one per layer, spending the same total width as `uniform_width` in every layer."""
    layers = int(profile["layers"])
    cost = profile_cost(profile, cfg)
    if cfg.exponent == "intrinsic":
        exponents = intrinsic_exponents(profile["intrinsic_dim"])
    else:
        exponents = np.full(layers, cfg.exponent_const)
    weights = None
    if cfg.weight_by_sensitivity:
        if profile.get("sensitivity") is None:
            raise StudyError(
                "weight_by_sensitivity",
                "the profile has no perturbation sensitivity",
                "profile again with measure_sensitivity=true, or set weight_by_sensitivity=false",
            )
        # A layer whose scaling lowers the loss (noise, or negative curvature) gets no weight, so it sits at w_min.
        weights = np.maximum(np.asarray(profile["sensitivity"], dtype=np.float64), 0.0)
    widths = allocate_widths(cost, layers * uniform_width, cfg.w_min_fraction * uniform_width, exponents, weights)
    return widths.tolist()
