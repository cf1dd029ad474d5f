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


def gromov_wasserstein(d_before: np.ndarray, d_after: np.ndarray, starts: str = "identity") -> float:
    """GW_2 distance (Memoli 2011) between two clouds given by their distance matrices, uniform weights."""
    return gromov_wasserstein_starts(d_before, d_after, starts)[0]


def gromov_wasserstein_starts(d_before: np.ndarray, d_after: np.ndarray, starts: str = "identity") -> tuple[float, str]:
    """GW_2 = 1/2 (min_T sum_ijkl (D_X[i,k] - D_Y[j,l])^2 T_ij T_kl)^(1/2) and the start it was reached from: the
    identity coupling I/n, and with `starts="both"` also POT's default product start, the lower kept.

    Both matrices are divided by one shared scale (the larger mean) and the result multiplied back, so the solver
    sees entries of order 1 and a uniform scaling of one cloud still counts as distortion. Tokens correspond, so I/n
    is the natural start; from the product start conditional gradient stopped 3-14x higher on the benchmark's clouds
    (benchmarks/geometry_bench.py), at the cost of the rest of the profile, hence opt-in.
    """
    n = d_before.shape[0]
    scale = max(float(d_before.mean()), float(d_after.mean()))
    if scale == 0.0:
        return 0.0, "identity"
    c_before, c_after = d_before / scale, d_after / scale
    losses = {"identity": _gw_loss_from_identity(c_before, c_after)}
    if starts == "both":
        import ot

        weights = np.full(n, 1.0 / n)
        # gromov_wasserstein's log holds gromov_wasserstein2's value without its two extra n^3 gradient products
        _, log = ot.gromov.gromov_wasserstein(c_before, c_after, weights, weights, "square_loss", log=True)
        losses["product"] = float(log["gw_dist"])
    start = min(losses, key=losses.get)
    return 0.5 * scale * float(np.sqrt(max(losses[start], 0.0))), start


def _gw_loss_from_identity(c_before: np.ndarray, c_after: np.ndarray) -> float:
    """The GW loss POT's conditional gradient reaches from the identity coupling I/n.

    Its first step (POT's own gradient and LP) is taken here: when the LP's solution is I/n itself, the solver would
    stop there, and the loss of I/n is returned in closed form, mean_ik (C_X[i,k] - C_Y[i,k])^2 (exact, and 2-3x
    cheaper than the solve). Otherwise the full solve runs from I/n.
    """
    import ot
    from ot.gromov._utils import gwggrad, init_matrix

    n = c_before.shape[0]
    weights = np.full(n, 1.0 / n)
    g0 = np.eye(n) / n
    closed_form = float(((c_before - c_after) ** 2).mean())
    nx = ot.backend.NumpyBackend()
    const_c, h_before, h_after = init_matrix(c_before, c_after, weights, weights, "square_loss", nx)
    direction = ot.emd(weights, weights, gwggrad(const_c, h_before, h_after, g0, nx))
    if np.count_nonzero(direction) == n and np.count_nonzero(np.diagonal(direction)) == n:
        return closed_form
    _, log = ot.gromov.gromov_wasserstein(c_before, c_after, weights, weights, "square_loss", G0=g0, log=True)
    return min(float(log["gw_dist"]), closed_form)


def vr_backend(choice: str = "auto") -> str:
    """The Vietoris-Rips backend: for `auto` giotto-ph (AGPL, an optional extra) when installed, else ripser."""
    if choice != "auto":
        return choice
    try:
        import gph  # noqa: F401
    except ImportError:
        return "ripser"
    return "gph"


def h1_diagram(distances: np.ndarray, threads: int = 2, backend: str = "auto") -> np.ndarray:
    """Degree-1 persistence diagram (k, 2) of the full Vietoris-Rips filtration on a distance matrix (every bar
    finite), rows sorted by (birth, death) so ripser and giotto-ph (same bars in float32; edge collapse off, 100x
    slower here) return the same array.

    It is computed on a filtration cut at t, and the cut certified: no bar of positive length is born above
    `h1_birth_bound`, and a bar born at or below t is exact unless it dies above t, when it comes back infinite and
    the run is repeated with twice the edges. On the benchmark's clouds the cut keeps 10-30 % of the edges: 4-13x
    faster, diagrams identical.
    """
    backend = vr_backend(backend)
    d32 = np.asarray(distances, dtype=np.float32)  # the values both backends filter by
    lengths = np.sort(d32[np.triu_indices(len(d32), 1)])
    if lengths.size == 0:
        return np.zeros((0, 2))
    birth_bound = h1_birth_bound(d32)
    # first cut: a quarter more edges than the birth bound needs (bars ended within that on the benchmark's clouds)
    edges = min(lengths.size, int(np.searchsorted(lengths, birth_bound, side="right") * 1.25) + 1)
    while True:
        threshold = float(lengths[edges - 1]) if edges < lengths.size else np.inf
        if backend == "gph":
            from gph import ripser_parallel

            dgm = ripser_parallel(d32, metric="precomputed", maxdim=1, thresh=threshold, n_threads=threads)["dgms"][1]
        else:
            from ripser import ripser

            dgm = ripser(d32, distance_matrix=True, maxdim=1, thresh=threshold)["dgms"][1]
        dgm = np.asarray(dgm, dtype=np.float64).reshape(-1, 2)
        dgm = dgm[np.lexsort((dgm[:, 1], dgm[:, 0]))]  # one order whatever the backend (they list bars differently)
        if np.isfinite(dgm[:, 1]).all() or threshold == np.inf:
            return dgm
        edges = min(lengths.size, 2 * edges)


def h1_birth_bound(d32: np.ndarray, candidates: int = 4, block: int = 64) -> float:
    """The length of the longest edge {u, v} with no witness w, d(u, w) < d(u, v) and d(v, w) < d(u, v): no H1 bar
    of positive length is born above it (with a witness the triangle uvw enters with the edge, whose bar has length
    zero). In float32, so ties are the backends'. Witnesses are looked for among each vertex's `candidates` nearest
    neighbours first, then among all vertices for the edges left.
    """
    n = len(d32)
    near = np.argpartition(d32, min(candidates, n - 1), axis=1)[:, : candidates + 1]
    witnessed = np.zeros((n, n), dtype=bool)
    for start in range(0, n, block):
        us = np.arange(start, min(start + block, n))
        to_candidates = np.take_along_axis(d32[us], near[us], axis=1)  # (b, k): d(u, w)
        from_candidates = d32[:, near[us]].transpose(1, 0, 2)  # (b, n, k): d(v, w)
        closest = np.maximum(to_candidates[:, None, :], from_candidates).min(axis=2)  # (b, n)
        witnessed[us] = closest < d32[us]
    witnessed |= witnessed.T
    u, v = np.nonzero(np.triu(~witnessed, 1))
    bound = 0.0
    for start in range(0, len(u), block):
        uu, vv = u[start:start + block], v[start:start + block]
        length = d32[uu, vv]
        has_witness = (np.maximum(d32[uu], d32[vv]) < length[:, None]).any(axis=1)
        if not has_witness.all():
            bound = max(bound, float(length[~has_witness].max()))
    return bound


def twonn_dimension(distances: np.ndarray, discard: float = 0.1) -> float:
    """Intrinsic dimension by TwoNN (Facco, d'Errico, Rodriguez, Laio 2017, Sci. Rep. 7:12140): mu_i = r2_i / r1_i is
    Pareto with exponent d on a locally uniform d-manifold, so d is the slope of -log(1 - F(mu)) on log(mu) through
    the origin, the largest `discard` fraction of mu left out as in the paper, and points with a duplicate (r1 = 0)
    too.
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
