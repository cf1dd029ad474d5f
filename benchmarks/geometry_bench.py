"""Geometry profile: our pipeline against the naive one, on the same transformer-like synthetic clouds.

ours: `study.geometry.profile.profile_clouds` (distance matrices shared, GW from the identity coupling in closed form
where it is the solver's fixed point, the hyperbolic diagram mapped from the spherical one, exact W2 by a min-cost
flow on the arcs an optimum can use or by network simplex (`study.geometry.matching`), layers in worker processes).
peer: the same statistics written directly, layer after layer in one process: POT `gromov_wasserstein2` from its
default start, `ripser` on each of the six matrices, W2 by a dense Hungarian assignment of the diagonal-augmented
diagrams (scipy `linear_sum_assignment`, the algorithm of `persim.wasserstein`, which returns W1 only).
Both run on every layer in the same run, and the row says how far the values differ.

The size is 12 layers x 1,024 tokens x d256 with or without --quick: it is the size the 10x claim is made at, and
smaller clouds measure mostly the workers' start-up (2.7 s of 9.6 s at 6 x 512). The naive path takes 11-12 minutes
of it.

    python benchmarks/geometry_bench.py      # one JSON line per figure; ratio > 1: ours is better
"""

from __future__ import annotations

import json
import time

import numpy as np

from benchmarks.common import load_average, row
from study.config.geometry import AllocationConfig
from study.geometry.clouds import TokenClouds
from study.geometry.geometries import GEOMETRIES, pairwise_distances
from study.geometry.profile import profile_clouds
from study.geometry.matching import diagram_w2
from study.geometry.work import h1_diagram, shift, twonn_dimension

FULL = (12, 1024, 256)
STAGES = ("distances", "shift", "gw", "topo", "intrinsic_dim")


def synthetic_clouds(layers: int, n: int, d: int, seed: int = 0) -> TokenClouds:
    """A residual stream with low-rank structure, a common offset, growing norm and a shrinking FFN increment."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, 16)) @ rng.normal(size=(16, d)) + 0.5 * rng.normal(size=(n, d)) + 1.0
    before, after = [], []
    for layer in range(layers):
        h = h + h @ rng.normal(scale=0.3 / np.sqrt(d), size=(d, d))
        hidden = np.tanh(h @ rng.normal(size=(d, 2 * d)) / np.linalg.norm(h, axis=1).mean())
        increment = hidden @ rng.normal(size=(2 * d, d))
        increment *= 0.4 / (1 + layer) ** 0.5 * np.linalg.norm(h) / np.linalg.norm(increment)
        before.append(h)
        h = h + increment
        after.append(h)
    as32 = lambda xs: np.stack(xs).astype(np.float32)  # noqa: E731
    return TokenClouds(as32(before), as32(after), np.zeros((n, 3), np.int64))


def hungarian_w2(a: np.ndarray, b: np.ndarray) -> float:
    """W2 between diagrams as a dense (n + m) x (n + m) assignment: each point may go to its own diagonal copy."""
    from scipy.optimize import linear_sum_assignment
    from scipy.spatial.distance import cdist

    n, m = len(a), len(b)
    big = np.inf
    cost = np.zeros((n + m, n + m))
    cost[:n, :m] = cdist(a, b, "sqeuclidean")
    cost[:n, m:] = big
    cost[n:, :m] = big
    cost[np.arange(n), m + np.arange(n)] = (a[:, 1] - a[:, 0]) ** 2 / 2
    cost[n + np.arange(m), np.arange(m)] = (b[:, 1] - b[:, 0]) ** 2 / 2
    rows, cols = linear_sum_assignment(cost)
    return float(np.sqrt(cost[rows, cols].sum()))


def peer_layer(before: np.ndarray, after: np.ndarray, radius: float, seconds: dict[str, float]) -> dict:
    import ot
    import ripser

    def timed(name, fn, *args, **kwargs):
        start = time.perf_counter()
        value = fn(*args, **kwargs)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return value

    n = len(before)
    weights = np.full(n, 1.0 / n)
    out = {}
    for g in GEOMETRIES:
        dx = timed("distances", pairwise_distances, before, g, radius)
        dy = timed("distances", pairwise_distances, after, g, radius)
        out["shift", g] = timed("shift", shift, before, after, g, radius)
        gw2 = timed("gw", ot.gromov.gromov_wasserstein2, dx, dy, weights, weights, "square_loss")
        out["gw", g] = 0.5 * float(np.sqrt(max(float(gw2), 0.0)))
        dgm_x = timed("topo", lambda d: ripser.ripser(d, distance_matrix=True, maxdim=1)["dgms"][1], dx)
        dgm_y = timed("topo", lambda d: ripser.ripser(d, distance_matrix=True, maxdim=1)["dgms"][1], dy)
        start = time.perf_counter()
        out["topo", g] = timed("topo", hungarian_w2, dgm_x.astype(np.float64), dgm_y.astype(np.float64))
        seconds["topo_w2"] = seconds.get("topo_w2", 0.0) + time.perf_counter() - start
        if g == "spherical":
            out["intrinsic_dim"] = timed("intrinsic_dim", twonn_dimension, dx)
    return out


def differences(ours: dict, peer: list[dict]) -> dict:
    """Largest absolute and relative differences of the exact statistics (topo per geometry: the hyperbolic diagram
    is mapped from the spherical one in float64, the peer's is filtered on float32 hyperbolic distances, so the two
    differ by float32 rounding there); GW as the ratio ours / peer (< 1: the identity start found the lower GW)."""
    out = {}
    for stat, geometries in (("shift", GEOMETRIES), ("topo", ("raw", "spherical")), ("topo", ("hyperbolic",))):
        a = np.array([ours["stats"][stat][g][layer] for layer in range(len(peer)) for g in geometries])
        b = np.array([p[stat, g] for p in peer for g in geometries])
        label = stat if stat == "shift" else f"{stat}_{'_'.join(geometries)}"
        out[f"{label}_max_abs_diff"] = float(np.abs(a - b).max())
        out[f"{label}_max_rel_diff"] = float((np.abs(a - b) / np.abs(b)).max())
    a, b = np.array(ours["intrinsic_dim"], float), np.array([p["intrinsic_dim"] for p in peer])
    out["intrinsic_dim_max_abs_diff"] = float(np.abs(a - b).max())
    gw = np.array([ours["stats"]["gw"][g][layer] / p["gw", g] for layer, p in enumerate(peer) for g in GEOMETRIES])
    out["gw_ours_over_peer_max"] = float(gw.max())
    out["gw_ours_over_peer_min"] = float(gw.min())
    return out


def run(quick: bool) -> list[dict]:
    layers, n, d = FULL  # --quick keeps the size: see the module's docstring
    shape = f"{layers} layers x {n} tokens x d{d}"
    clouds = synthetic_clouds(layers, n, d)
    cfg = AllocationConfig(diagram_workers=-1)
    load = load_average()
    ours = profile_clouds(clouds, cfg)

    peer_seconds: dict[str, float] = {}
    start = time.perf_counter()
    peer = [peer_layer(clouds.before[layer], clouds.after[layer], cfg.hyperbolic_radius, peer_seconds)
            for layer in range(layers)]
    peer_wall = time.perf_counter() - start

    rows = [row(f"geometry profile wall time vs the naive path ({shape})", ours["timings"]["wall"], peer_wall, "s",
                "lower", **differences(ours, peer), load_before=load, load_after=load_average())]
    for stage in STAGES:
        rows.append(row(f"geometry {stage} seconds, summed over layers and processes ({shape})",
                        ours["timings"][stage], peer_seconds.get(stage, 0.0), "s", "lower"))
    rows.append(row(f"geometry topo: diagram-distance seconds within topo ({shape})", ours["timings"]["topo_w2"],
                    peer_seconds["topo_w2"], "s", "lower"))
    gw_ours = np.mean([ours["stats"]["gw"][g][layer] for g in GEOMETRIES for layer in range(layers)])
    gw_peer = np.mean([p["gw", g] for p in peer for g in GEOMETRIES])
    rows.append(row("geometry GW found, mean over layers x geometries (identity start vs product start)",
                    gw_ours, gw_peer, "GW_2", "lower"))
    rows.append(_w2_solvers(clouds, cfg.hyperbolic_radius))
    return rows


def _w2_solvers(clouds: TokenClouds, radius: float) -> dict:
    """Our exact W2 (the solver `auto` picks: the network simplex on these) against Hera's auction at 1 % tolerance, on
    the first layer's spherical diagrams (CPU seconds)."""
    from gudhi.hera import wasserstein_distance

    a, b = (h1_diagram(pairwise_distances(x[0], "spherical", radius)) for x in (clouds.before, clouds.after))
    start = time.process_time()
    diagram_w2(a, b)
    ours = time.process_time() - start
    start = time.process_time()
    wasserstein_distance(a, b, order=2, internal_p=2, delta=0.01)
    hera = time.process_time() - start
    name = f"geometry diagram W2 CPU seconds, exact (auto) vs Hera delta=0.01 ({len(a)} vs {len(b)} bars)"
    return row(name, ours, hera, "s", "lower")


if __name__ == "__main__":
    for r in run(quick=False):
        print(json.dumps(r))
