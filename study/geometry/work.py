"""The geometric work an FFN sublayer does on a token cloud, and the cloud's intrinsic dimension.

For one layer, X = token states before the FFN sublayer and Y = after it, row i the same token in both:

    shift: mean_i d(x_i, y_i)                                   (correspondence kept)
    gw:    Gromov-Wasserstein distance between D_X and D_Y      (metric distortion, correspondence not assumed)
    topo:  W_2(Dgm_1(VR(D_X)), Dgm_1(VR(D_Y)))                  (change of the degree-1 persistence diagram)

with d, D_X, D_Y under one geometry (`geometries.py`). All three are homogeneous of degree 1 in the distances, so
they share the geometry's units and scale the same way under a uniform scaling of the cloud.
"""

from __future__ import annotations

import numpy as np

from study.geometry.geometries import pointwise_distances


def shift(before: np.ndarray, after: np.ndarray, geometry: str, radius: float = 0.9) -> float:
    """Mean distance between corresponding tokens before and after the sublayer."""
    return float(pointwise_distances(before, after, geometry, radius).mean())


def gromov_wasserstein(d_before: np.ndarray, d_after: np.ndarray) -> float:
    """GW_2 distance (Memoli 2011) between two clouds given by their distance matrices, uniform weights."""
    return gromov_wasserstein_starts(d_before, d_after)[0]


def gromov_wasserstein_starts(d_before: np.ndarray, d_after: np.ndarray) -> tuple[float, str]:
    """GW_2 and the start it was reached from: the smaller of the solves from the identity coupling and from POT's
    default start (the product coupling).

    GW_2 = 1/2 (min_T sum_ijkl (D_X[i,k] - D_Y[j,l])^2 T_ij T_kl)^(1/2), so it is in the units of the distances.
    Both matrices are divided by one shared scale (the larger of their mean entries) before solving and the result
    multiplied back: the solver sees entries of order 1 whatever the geometry, and a uniform scaling of one cloud
    still shows up as distortion (raw geometry), which normalising each matrix by its own scale would hide.

    In high dimensions the GW objective is nearly flat and conditional gradient from POT's default start can stop at
    a poor local optimum (14x above the identity's cost on one synthetic cloud). Tokens correspond, so the identity
    coupling I/n is the natural start (the result is never worse than the distortion of the correspondence
    itself); the default start is solved too, as the paper's measurement would be, and the lower value is kept.
    """
    import ot

    n = d_before.shape[0]
    scale = max(float(d_before.mean()), float(d_after.mean()))
    if scale == 0.0:
        return 0.0, "identity"
    weights = np.full(n, 1.0 / n)
    c_before, c_after = d_before / scale, d_after / scale
    losses = {}
    for start, g0 in (("identity", np.eye(n) / n), ("product", None)):
        # gromov_wasserstein's log holds the same value gromov_wasserstein2 returns, without the two extra n^3
        # products gromov_wasserstein2 spends on gradients for autodiff backends.
        _, log = ot.gromov.gromov_wasserstein(c_before, c_after, weights, weights, "square_loss", G0=g0, log=True)
        losses[start] = float(log["gw_dist"])
    # The solver evaluates its loss through an expansion that cancels to ~1e-16 instead of 0; the identity
    # coupling's loss, computed directly, is exact, so it bounds what the identity start reached.
    losses["identity"] = min(losses["identity"], float(((c_before - c_after) ** 2).mean()))
    start = min(losses, key=losses.get)
    return 0.5 * scale * float(np.sqrt(max(losses[start], 0.0))), start


def vr_backend(choice: str = "auto") -> str:
    """The Vietoris-Rips backend to use: giotto-ph (AGPL, an optional extra) for `auto` when it is installed,
    else ripser (MIT, always installed)."""
    if choice != "auto":
        return choice
    try:
        import gph  # noqa: F401
    except ImportError:
        return "ripser"
    return "gph"


def h1_diagram(distances: np.ndarray, threads: int = 2, backend: str = "auto") -> np.ndarray:
    """Degree-1 persistence diagram (k, 2) of the Vietoris-Rips filtration on a distance matrix.

    The full filtration is built (no threshold), so every H1 bar dies and the diagram has no infinite points.
    ripser and giotto-ph run the same algorithm in float32 and return the same diagram bit for bit; giotto-ph is
    multithreaded. Its edge collapse is left off: on transformer-like clouds it made giotto-ph 100x slower.
    """
    backend = vr_backend(backend)
    if backend == "gph":
        from gph import ripser_parallel

        dgm = ripser_parallel(distances, metric="precomputed", maxdim=1, n_threads=threads)["dgms"][1]
    else:
        from ripser import ripser

        dgm = ripser(distances, distance_matrix=True, maxdim=1)["dgms"][1]
    return np.asarray(dgm, dtype=np.float64)


def diagram_w2(a: np.ndarray, b: np.ndarray) -> float:
    """Exact 2-Wasserstein distance between persistence diagrams, Euclidean ground metric in the plane.

    The optimal partial matching, where a point may instead go to the diagonal at cost persistence^2 / 2, is a
    transport problem of size (n + 1) x (m + 1): one extra node per side stands for the diagonal and carries the
    other diagram's mass (the formulation of gudhi.wasserstein), solved exactly by POT's network simplex.
    On six pairs of 1800-3100-bar diagrams from synthetic token clouds it took 27 % fewer CPU-seconds in all than
    gudhi's Hera auction at 1 % tolerance (faster on five pairs, slower on the one whose diagrams differed most)
    and under half the time of persim's dense Hungarian assignment (benchmarks/geometry_bench.py). The iteration cap grows with the problem: POT's default (and gudhi's 2e6) can stop short of the
    optimum on diagrams of a few thousand points.
    """
    import ot
    from scipy.spatial.distance import cdist

    n, m = len(a), len(b)
    if n == 0 and m == 0:
        return 0.0
    to_diagonal_a = (a[:, 1] - a[:, 0]) ** 2 / 2
    to_diagonal_b = (b[:, 1] - b[:, 0]) ** 2 / 2
    cost = np.zeros((n + 1, m + 1))
    if n and m:
        cost[:n, :m] = cdist(a, b, "sqeuclidean")
    cost[:n, m] = to_diagonal_a
    cost[n, :m] = to_diagonal_b
    mass_a = np.concatenate([np.ones(n), [m]])
    mass_b = np.concatenate([np.ones(m), [n]])
    value, log = ot.emd2(mass_a, mass_b, cost, numItermax=max(2_000_000, 50 * cost.size), log=True)
    if log["warning"] is not None:
        raise RuntimeError(f"diagram transport did not reach the optimum: {log['warning']}")
    return float(np.sqrt(max(float(value), 0.0)))


def timed_diagram_w2(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """`diagram_w2` and its duration in seconds (it runs in worker processes, whose time the profile reports)."""
    import time

    import ot  # noqa: F401  (before the clock: a fresh worker pays the import, ~2 s, once)

    start = time.perf_counter()
    value = diagram_w2(a, b)
    return value, time.perf_counter() - start


def twonn_dimension(distances: np.ndarray, discard: float = 0.1) -> float:
    """Intrinsic dimension by TwoNN (Facco, d'Errico, Rodriguez, Laio 2017, Sci. Rep. 7:12140).

    mu_i = r2_i / r1_i (second over first nearest-neighbour distance) is Pareto with exponent d on a locally
    uniform d-dimensional manifold, so -log(1 - F(mu)) = d log(mu): d is the slope of a least-squares fit through
    the origin, after discarding the largest `discard` fraction of mu as the paper does (they come from
    neighbourhoods too sparse for the local uniformity assumption). Points with a duplicate (r1 = 0, e.g. the same
    token at the same position in two sequences) carry no ratio and are left out.
    """
    d = np.array(distances, dtype=np.float64)
    np.fill_diagonal(d, np.inf)
    nearest = np.partition(d, 1, axis=1)[:, :2]
    r1, r2 = nearest[:, 0], nearest[:, 1]
    keep = r1 > 0
    mu = np.sort(r2[keep] / r1[keep])
    n = mu.size
    kept = int(np.floor(n * (1.0 - discard)))
    if kept < 2:
        return float("nan")
    x = np.log(mu[:kept])
    y = -np.log(1.0 - np.arange(1, kept + 1) / n)
    denom = float(x @ x)
    return float(x @ y / denom) if denom > 0 else float("nan")
