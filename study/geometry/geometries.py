"""Distances between token states under the three geometries of study 2.

    raw:        d(x, y) = |x - y|                                   (unnormalised states: the scale-sensitive control)
    spherical:  d(x, y) = arccos <u, v>,   u = x / |x|, v = y / |y|   (angle between unit-normalised states)
    hyperbolic: d(x, y) = arccosh(1 + 2 |p - q|^2 / ((1 - |p|^2)(1 - |q|^2))),   p = r u, q = r v
                (unit-normalised states placed in the Poincare ball at the fixed radius r)

Both normalised distances are computed from the chord c = |u - v|: the angle as 2 arcsin(c / 2) (precise at small
angles, where arccos loses half the digits), the Poincare distance as arccosh(1 + 2 r^2 c^2 / (1 - r^2)^2), an
increasing function of the angle (`angle_to_poincare`). Everything is float64.
"""

from __future__ import annotations

import numpy as np

from study.config.geometry import GEOMETRIES, check_radius, one_of


def unit_normalise(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit Euclidean norm (a zero row stays zero rather than becoming NaN)."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, np.finfo(np.float64).tiny)


def _squared_euclidean(x: np.ndarray) -> np.ndarray:
    """|x_i - x_j|^2 through the Gram matrix (one BLAS call), clipped at 0 and exactly 0 on the diagonal."""
    sq = np.einsum("ij,ij->i", x, x)
    d2 = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    np.maximum(d2, 0.0, out=d2)
    np.fill_diagonal(d2, 0.0)
    return d2


def _chord_to_distance(chord_sq: np.ndarray, geometry: str, radius: float) -> np.ndarray:
    if geometry == "spherical":
        return 2.0 * np.arcsin(np.minimum(np.sqrt(chord_sq) / 2.0, 1.0))
    z = 2.0 * radius**2 * chord_sq / (1.0 - radius**2) ** 2
    # arccosh(1 + z) written with log1p: the direct form rounds 1 + z and loses small distances.
    return np.log1p(z + np.sqrt(z * (z + 2.0)))


def angle_to_poincare(theta: np.ndarray, radius: float) -> np.ndarray:
    """Poincare distance between two points at `radius` whose directions are `theta` radians apart."""
    chord_sq = (2.0 * np.sin(np.asarray(theta, dtype=np.float64) / 2.0)) ** 2
    return _chord_to_distance(chord_sq, "hyperbolic", radius)


def pairwise_distances(x: np.ndarray, geometry: str, radius: float = 0.9) -> np.ndarray:
    """(n, n) distance matrix of the cloud `x` (n, d) under `geometry` (raw: of the centred cloud, so the Gram
    expansion does not cancel the stream's large common component)."""
    one_of("geometry", geometry, GEOMETRIES)
    x = np.asarray(x, dtype=np.float64)
    if geometry == "raw":
        return np.sqrt(_squared_euclidean(x - x.mean(axis=0)))
    check_radius(radius)
    return _chord_to_distance(_squared_euclidean(unit_normalise(x)), geometry, radius)


def pointwise_distances(x: np.ndarray, y: np.ndarray, geometry: str, radius: float = 0.9) -> np.ndarray:
    """(n,) distances between corresponding rows of `x` and `y` (token i before and after)."""
    one_of("geometry", geometry, GEOMETRIES)
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if geometry == "raw":
        return np.linalg.norm(x - y, axis=1)
    check_radius(radius)
    diff = unit_normalise(x) - unit_normalise(y)
    return _chord_to_distance(np.einsum("ij,ij->i", diff, diff), geometry, radius)
