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
    """GW_2 and the start it was reached from: the solve from the identity coupling, and with `starts="both"` also
    the solve from POT's default start (the product coupling), the lower kept.

    GW_2 = 1/2 (min_T sum_ijkl (D_X[i,k] - D_Y[j,l])^2 T_ij T_kl)^(1/2), so it is in the units of the distances.
    Both matrices are divided by one shared scale (the larger of their mean entries) before solving and the result
    multiplied back: the solver sees entries of order 1 whatever the geometry, and a uniform scaling of one cloud
    still shows up as distortion (raw geometry), which normalising each matrix by its own scale would hide.

    In high dimensions the GW objective is nearly flat and conditional gradient from POT's default start can stop at
    a poor local optimum (14x above the identity's cost on one synthetic cloud; 3-10x above it in every layer and
    geometry of benchmarks/geometry_bench.py, which checks this on every run). Tokens correspond, so the identity
    coupling I/n is the natural start: the result is never worse than the distortion of the correspondence itself.
    The product start costs as much as the rest of the profile together and has never given the lower value, so it
    is the opt-in `starts="both"`.
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
        # gromov_wasserstein's log holds the same value gromov_wasserstein2 returns, without the two extra n^3
        # products gromov_wasserstein2 spends on gradients for autodiff backends.
        _, log = ot.gromov.gromov_wasserstein(c_before, c_after, weights, weights, "square_loss", log=True)
        losses["product"] = float(log["gw_dist"])
    start = min(losses, key=losses.get)
    return 0.5 * scale * float(np.sqrt(max(losses[start], 0.0))), start


def _gw_loss_from_identity(c_before: np.ndarray, c_after: np.ndarray) -> float:
    """The GW loss POT's conditional gradient reaches from the identity coupling I/n.

    The solver's first step solves the linear program of the loss's gradient at I/n; when that program's solution is
    I/n itself (the identity is a stationary point: no coupling decreases the linearised loss), the direction is
    zero, the loss does not change and the solver stops at I/n. That first step is taken here with POT's own
    gradient and LP solver, and then the loss of I/n is returned in closed form, mean_ik (C_X[i,k] - C_Y[i,k])^2,
    which is exact where the solver's expansion of it cancels to ~1e-16 instead of 0; a full solve costs 2-3x more
    (one line search and loss evaluation per iteration). Otherwise the full solve runs from I/n, as before.
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
    """Degree-1 persistence diagram (k, 2) of the Vietoris-Rips filtration on a distance matrix, exactly the
    diagram of the full filtration (every H1 bar dies, no infinite points), computed on a truncated one.

    ripser and giotto-ph run the same algorithm in float32 and find the same bars bit for bit, listed in different
    orders; the rows are sorted by (birth, death), so the two return the same array. giotto-ph is multithreaded. Its edge collapse is left off: on transformer-like clouds it made giotto-ph 100x slower.

    The filtration is cut at a threshold t and the cut is certified, so the diagram is the full one:
    - no bar of positive length is born above `h1_birth_bound` (every longer edge closes a triangle at its own
      length), so every bar is born at or below t when t is at least that bound;
    - a bar born at or below t is exact in the truncated filtration unless it dies above t, when it comes back
      infinite; then t is raised (the number of edges doubled) and the run repeated, up to the full filtration.
    The bars end by the 10-30th percentile of the distances on the benchmark's clouds, so the cut leaves 10-30 %
    of the edges and far fewer triangles: Ripser ran 4-13x faster, diagrams identical.
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
        dgm = _vr_h1(d32, threshold, threads, backend)
        if np.isfinite(dgm[:, 1]).all() or threshold == np.inf:
            return dgm
        edges = min(lengths.size, 2 * edges)


def _vr_h1(d32: np.ndarray, threshold: float, threads: int, backend: str) -> np.ndarray:
    if backend == "gph":
        from gph import ripser_parallel

        dgm = ripser_parallel(d32, metric="precomputed", maxdim=1, thresh=threshold, n_threads=threads)["dgms"][1]
    else:
        from ripser import ripser

        dgm = ripser(d32, distance_matrix=True, maxdim=1, thresh=threshold)["dgms"][1]
    dgm = np.asarray(dgm, dtype=np.float64).reshape(-1, 2)
    return dgm[np.lexsort((dgm[:, 1], dgm[:, 0]))]  # one order whatever the backend (they list bars differently)


def h1_birth_bound(d32: np.ndarray, candidates: int = 4, block: int = 64) -> float:
    """The length of the longest edge {u, v} with no witness w, d(u, w) < d(u, v) and d(v, w) < d(u, v): no H1 bar
    of positive length is born above it.

    With a witness, the triangle uvw enters the filtration at d(u, v) itself, right after the edge (it is the
    triangle's strictly longest edge): the cycle the edge closes is a boundary at once, the edge is paired with a
    triangle of its own length, and the bar it would start has length zero (neither backend reports those).
    Computed in float32, the values the backends filter by, so ties are the backends' ties. Witnesses are looked
    for among each vertex's `candidates` nearest neighbours first (n^2 x 4 comparisons: they witness nearly every
    long edge), then among all vertices for the edges left.
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
