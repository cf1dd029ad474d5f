"""Per-layer width schedules: the shape of the widths (and, for layer-wise scaling, the heads) across depth, before
the budget fixes their scale.

With t = l / (L - 1), d_s = start x base and d_e = end x base (base: the uniform width):

    linear     d(l) = d_s + (d_e - d_s) t                                         (TLM, arXiv 2606.23670)
    cosine     d(l) = d_e + (d_s - d_e) (1 + cos(pi t)) / 2
    sigmoid    d(l) = d_e + (d_s - d_e) (s(k (1/2 - t)) - s(-k/2)) / (s(k/2) - s(-k/2)),  s the logistic
    layerwise  d(l) = beta_l d_model, q_l = alpha_l d_model / head_dim in whole KV groups (OpenELM; arXiv 2509.06518)

`reverse` reflects a family about its midrange; a `geometry` schedule arrives reflected from the allocator
(study.geometry.allocate.reflect_allocation). The budget matcher (`study.plan.budget.solve_ffn`) keeps the shape and
solves one scale factor for the FFN widths.
"""

from __future__ import annotations

import math

from study.config.geometry import one_of
from study.config.model import FAMILIES, ModelConfig, WidthSchedule
from study.errors import StudyError

FIELD = "model.ffn.schedule"


def _taper(n_layers: int, base: float, start: float, end: float, curve) -> list[float]:
    """`curve(d_s, d_e, l, L - 1)` at every layer; one layer takes the mean of the ends."""
    if n_layers == 1:
        return [base * (start + end) / 2]
    return [curve(start * base, end * base, l, n_layers - 1) for l in range(n_layers)]


def cosine_taper(n_layers: int, base: float, start: float = 1.5, end: float = 0.5) -> list[float]:
    """Tapered Language Models (arXiv 2606.23670): d_e + (d_s - d_e) (1 + cos(pi t)) / 2 (mean 1.0 x base)."""
    return _taper(n_layers, base, start, end,
                  lambda ds, de, l, span: de + (ds - de) * (1 + math.cos(math.pi * l / span)) / 2)


def linear_taper(n_layers: int, base: float, start: float = 1.5, end: float = 0.5) -> list[float]:
    """TLM's linear taper: d(l) = d_s + (d_e - d_s) l / (L - 1)."""
    return _taper(n_layers, base, start, end, lambda ds, de, l, span: ds + (de - ds) * l / span)


def sigmoid_taper(n_layers: int, base: float, start: float = 1.5, end: float = 0.5,
                  steepness: float = 8.0) -> list[float]:
    """TLM's sigmoid taper: a logistic step from d_s to d_e at mid-depth, scaled to meet both ends exactly."""
    def logistic(x: float) -> float:
        return 1.0 / (1.0 + math.exp(-x))

    low, high = logistic(-steepness / 2), logistic(steepness / 2)
    return _taper(n_layers, base, start, end, lambda ds, de, l, span: de + (ds - de) * (
        logistic(steepness * (0.5 - l / span)) - low) / (high - low))


def interpolate(points: list[float], n_layers: int) -> list[float]:
    """The piecewise-linear curve through `points`, spread evenly over the layers (numpy.interp; two points give
    numpy.linspace's values, as corenet interpolates, so OpenELM's multipliers round alike)."""
    import numpy as np

    m = len(points)
    if n_layers == 1:
        return [(points[0] + points[-1]) / 2 if m % 2 == 0 else points[m // 2]]
    knots = [j * (n_layers - 1) / (m - 1) for j in range(m)]  # the layer position of each point
    return np.interp(range(n_layers), knots, points).tolist()


def reflect(values: list[float]) -> list[float]:
    """The `reverse` operator: reflected about the midrange, same range and spacing, opposite order."""
    top, bottom = max(values), min(values)
    return [top + bottom - v for v in values]


def make_divisible(value: float, divisor: int) -> int:
    """corenet's rounding (from TF-slim MobileNet): the nearest multiple of `divisor`, at least one, and one more when
    that falls more than 10 % below `value`."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _check_ratio(name: str, values: list[float], counts: tuple[int, ...] = (1,)) -> None:
    if len(values) not in counts:
        raise StudyError(f"{FIELD}.{name}", f"has {len(values)} points",
                         f"give {' or '.join(map(str, counts))} multipliers (first, [middle,] last layer)")
    if bad := [v for v in values if not v > 0]:
        raise StudyError(f"{FIELD}.{name}", f"a width or head ratio must be positive, got {bad[0]}",
                         "use ratios > 0 (1.0 is the uniform width)")


def check_schedule(s: WidthSchedule, n_layers: int) -> None:
    """Refuse an unknown family or parameters no schedule can have, naming the field."""
    one_of(FIELD, s.family, tuple(FAMILIES), "schedule family")
    if s.family in ("linear", "cosine", "sigmoid"):
        _check_ratio("start", [s.start])
        _check_ratio("end", [s.end])
    if s.family == "sigmoid" and not s.steepness > 0:
        raise StudyError(f"{FIELD}.steepness", f"must be positive, got {s.steepness}", "use e.g. 8 (0 < k)")
    if s.family == "layerwise":
        _check_ratio("beta", list(s.beta), (2, 3))
        if s.alpha:
            _check_ratio("alpha", list(s.alpha), (2, 3))
        if s.isotropic_ends and n_layers < 3:
            raise StudyError(f"{FIELD}.isotropic_ends", f"needs layers between the two ends, the model has {n_layers}",
                             "use at least 3 layers, or isotropic_ends=false")


def _layerwise(model: ModelConfig, base: float) -> tuple[list[float], list[int] | None]:
    """OpenELM's layer-wise scaling (corenet GPTConfig): beta_l and alpha_l interpolated across depth, rounded to two
    decimals; FFN shape beta_l d_model, query heads make_divisible(alpha_l d_model, head_dim x group) / head_dim.
    `isotropic_ends` keeps the first and last layer at the declared width and heads (Frame)."""
    s = model.ffn.schedule
    inner = model.n_layers - 2 if s.isotropic_ends else model.n_layers

    def multipliers(points: list[float]) -> list[float]:
        values = interpolate(list(points), inner)
        return [round(v, 2) for v in (reflect(values) if s.reverse else values)]

    def framed(values: list, end) -> list:
        return [end, *values, end] if s.isotropic_ends else values

    shape = framed([b * model.d_model for b in multipliers(s.beta)], float(base))
    if not s.alpha:
        return shape, None
    group, hd = model.kv_group, model.dim_head
    heads = []
    for layer, a in enumerate(multipliers(s.alpha)):
        if a * model.d_model / hd < 0.5:
            raise StudyError(f"{FIELD}.alpha", f"layer {layer + (1 if s.isotropic_ends else 0)} gets "
                             f"alpha = {a:g}, {a * model.d_model / hd:.2f} heads of {hd} dimensions: zero heads",
                             f"raise alpha so that alpha x d_model ({model.d_model}) is at least half a head "
                             f"({hd / 2:g})")
        heads.append(make_divisible(a * model.d_model, hd * group) // hd)
    return shape, framed(heads, model.n_heads)


def schedule_shape(model: ModelConfig, base: float) -> tuple[list[float] | None, list[int] | None]:
    """(relative per-layer widths, query heads per layer or None) of the model's schedule; widths None for
    `geometry` until a profile gives them."""
    s, n_layers = model.ffn.schedule, model.n_layers
    check_schedule(s, n_layers)
    if s.family == "uniform":
        return [float(base)] * n_layers, None
    if s.family == "layerwise":
        return _layerwise(model, base)
    if s.family in ("linear", "cosine", "sigmoid"):
        taper = {"linear": linear_taper, "cosine": cosine_taper, "sigmoid": sigmoid_taper}[s.family]
        extra = (s.steepness,) if s.family == "sigmoid" else ()
        shape = taper(n_layers, base, s.start, s.end, *extra)
        return (reflect(shape) if s.reverse else shape), None
    widths = model.ffn.widths
    if widths is None:
        if s.family == "geometry":
            return None, None
        raise StudyError("model.ffn.widths", "the `explicit` schedule needs a list of widths",
                         f"set model.ffn.widths to a list of {n_layers} positive numbers")
    if len(widths) != n_layers:
        raise StudyError("model.ffn.widths", f"{len(widths)} widths given for {n_layers} layers",
                         f"give exactly {n_layers} widths, one per layer")
    if min(widths) <= 0:
        raise StudyError("model.ffn.widths", "widths must be positive", "use widths greater than 0")
    shape = [float(w) for w in widths]
    # geometry widths come from the allocator, reflected there (the anti control) when reversed
    return (reflect(shape) if s.reverse and s.family == "explicit" else shape), None
