"""Geometry profile: our pipeline against a straightforward one, on transformer-like synthetic clouds.

ours: `study.geometry.profile.profile_clouds` (distance matrices shared, GW from the identity coupling, giotto-ph
diagrams with the hyperbolic one mapped from the spherical, Hera W2 in worker processes).
peer: the same statistics written directly: POT `gromov_wasserstein2` from its default start, `ripser` on each of
the six matrices, `persim.wasserstein` (a dense Hungarian assignment of the same size as W2's; persim 0.4 returns
W1, so its time is the comparable part). In the full run the peer is timed on `PEER_LAYERS` layers and scaled to
all layers, and the row says so.

    python benchmarks/geometry_bench.py [--quick]      # one JSON line per figure; ratio = ours / peer
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from study.config.geometry import AllocationConfig
from study.geometry.clouds import TokenClouds
from study.geometry.geometries import GEOMETRIES, pairwise_distances
from study.geometry.profile import profile_clouds
from study.geometry.work import diagram_w2, h1_diagram, shift, twonn_dimension

PEER_LAYERS = 2


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


def peer_layer(before: np.ndarray, after: np.ndarray, radius: float, seconds: dict[str, float]) -> dict:
    import ot
    import persim
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
        out[("shift", g)] = timed("shift", shift, before, after, g, radius)
        gw2 = timed("gw", ot.gromov.gromov_wasserstein2, dx, dy, weights, weights, "square_loss")
        out[("gw", g)] = 0.5 * float(np.sqrt(max(float(gw2), 0.0)))
        dgm_x = timed("topo", lambda d: ripser.ripser(d, distance_matrix=True, maxdim=1)["dgms"][1], dx)
        dgm_y = timed("topo", lambda d: ripser.ripser(d, distance_matrix=True, maxdim=1)["dgms"][1], dy)
        start = time.perf_counter()
        out[("topo", g)] = timed("topo", persim.wasserstein, dgm_x, dgm_y)
        seconds["topo_w2"] = seconds.get("topo_w2", 0.0) + time.perf_counter() - start
        if g == "spherical":
            timed("intrinsic_dim", twonn_dimension, dx)
    return out


def run(quick: bool) -> list[dict]:
    layers, n, d = (3, 256, 64) if quick else (12, 1024, 256)
    peer_layers = layers if quick else PEER_LAYERS
    shape = f"{layers} layers x {n} tokens x d={d}"
    clouds = synthetic_clouds(layers, n, d)
    cfg = AllocationConfig(diagram_workers=-1)
    ours = profile_clouds(clouds, cfg)

    peer_seconds: dict[str, float] = {}
    start = time.perf_counter()
    peer = [
        peer_layer(clouds.before[layer], clouds.after[layer], cfg.hyperbolic_radius, peer_seconds)
        for layer in range(peer_layers)
    ]
    peer_wall = (time.perf_counter() - start) * layers / peer_layers
    scale = layers / peer_layers
    note = "" if peer_layers == layers else f", peer timed on {peer_layers} layers and scaled x{scale:g}"

    rows = [_row(f"profile wall time ({shape}{note})", ours["timings"]["wall"], peer_wall, "s")]
    stages = ("distances", "shift", "gw", "topo", "intrinsic_dim")
    total_ours = sum(ours["timings"][s] for s in stages)
    total_peer = sum(peer_seconds.get(s, 0.0) for s in stages)
    for stage in stages:
        ours_s, peer_s = ours["timings"][stage], peer_seconds.get(stage, 0.0)
        rows.append(_row(f"{stage} seconds ({shape}{note})", ours_s, peer_s * scale, "s"))
        rows.append(_row(f"{stage} share of stage seconds", ours_s / total_ours, peer_s / total_peer, "fraction"))
    gw_ours = np.mean([ours["stats"]["gw"][g][layer] for g in GEOMETRIES for layer in range(peer_layers)])
    gw_peer = np.mean([p[("gw", g)] for p in peer for g in GEOMETRIES])
    rows.append(_row("topo: diagram-distance seconds within topo (rest: Vietoris-Rips)", ours["timings"]["topo_w2"],
                     peer_seconds["topo_w2"] * scale, "s"))
    name = "GW found, mean over layers x geometries (identity start vs product start; lower is better)"
    rows.append(_row(name, gw_ours, gw_peer, "GW_2"))
    rows.append(_w2_solvers(clouds, cfg.hyperbolic_radius))
    return rows


def _w2_solvers(clouds: TokenClouds, radius: float) -> dict:
    """Our exact W2 against Hera's auction at 1 % tolerance, on the first layer's spherical diagrams (CPU seconds)."""
    from gudhi.hera import wasserstein_distance

    a, b = (h1_diagram(pairwise_distances(x[0], "spherical", radius)) for x in (clouds.before, clouds.after))
    start = time.process_time()
    diagram_w2(a, b)
    ours = time.process_time() - start
    start = time.process_time()
    wasserstein_distance(a, b, order=2, internal_p=2, delta=0.01)
    hera = time.process_time() - start
    name = f"diagram W2 CPU seconds, exact network simplex vs Hera delta=0.01 ({len(a)} vs {len(b)} bars)"
    return _row(name, ours, hera, "s")


def _row(name: str, ours: float, peer: float, units: str) -> dict:
    ratio = float(ours) / peer if peer else float("nan")
    return {"name": name, "ours": float(ours), "peer": float(peer), "ratio": ratio, "units": units}


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(json.dumps(row))
