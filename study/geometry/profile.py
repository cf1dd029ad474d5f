"""The work profile of a model: every statistic under every geometry, layer by layer (study 2, step 3).

Per layer the six distance matrices are computed once; the hyperbolic persistence diagram is the spherical one with
its values mapped (`angle_to_poincare`: the same filtration order). Layers run in single-threaded worker processes,
one per core: Ripser, the network simplex and POT's loops are serial, and threads inside one process left cores idle
(or, mixed with processes, oversubscribed them: GW's BLAS ran up to 50x slower).
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
from concurrent.futures import Executor
from contextlib import contextmanager, nullcontext

import numpy as np

from study.config.geometry import STATISTICS, AllocationConfig
from study.geometry.clouds import TokenClouds
from study.geometry.geometries import GEOMETRIES, angle_to_poincare, pairwise_distances
from study.geometry.matching import diagram_w2
from study.geometry.work import gromov_wasserstein_starts, h1_diagram, shift, twonn_dimension, vr_backend

METHODS = {
    "shift": "mean distance between corresponding tokens",
    "gw": "GW_2 = 0.5 sqrt(min GW loss), POT conditional gradient from the identity coupling (closed form where "
    "the identity is the solver's fixed point), and from POT's default (product) start with gw_starts=both, the lower "
    "kept (gw_start says which), uniform weights, both matrices divided by the larger mean distance and the result "
    "scaled back",
    "topo": "exact W_2 (L2 ground metric; OR-tools min-cost flow on the arcs an optimum can use, or POT's network "
    "simplex where most arcs stay: study.geometry.matching) between H1 Vietoris-Rips diagrams (Ripser's "
    "algorithm, full filtration; vr_backend names the implementation)",
    "intrinsic_dim": "TwoNN (Facco et al. 2017, 10% discarded) on angular distances of the cloud the FFN receives "
    "(after the block's pre-norm, gains included, where it has one)",
    "sensitivity": "(L(1+eps) + L(1-eps)) / 2 - L(1), FFN branch scaled by 1 +- eps",
}


def _cores() -> int:
    # The affinity mask, not os.cpu_count(): under SLURM it is the job's allocation, not the whole node.
    return len(os.sched_getaffinity(0))


# Below this many tokens a layer takes well under a second and starting worker processes costs seconds.
POOL_MIN_TOKENS = 512


def _executor(workers: int, n_tokens: int, layers: int) -> tuple[Executor | None, int]:
    """The pool layers run in (None: in this process, one after another), and the threads each layer's
    Vietoris-Rips may use."""
    if workers == -1:
        workers = _cores()
    workers = min(workers, layers)
    if workers <= 1 or n_tokens < POOL_MIN_TOKENS:
        return None, _cores()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the caller has usually loaded torch and its thread pools, which fork does not copy safely.
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_single_threaded)
    return pool, 1


def _single_threaded() -> None:
    """Worker set-up: one BLAS thread, and POT without its torch backend (seconds to import, unused on numpy)."""
    os.environ.setdefault("POT_BACKEND_DISABLE_PYTORCH", "1")
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    import ot  # noqa: F401  (imported once per worker, before the first layer's clock starts)


@contextmanager
def _timed(seconds: dict[str, float], name: str):
    """Adds the block's wall time to `seconds[name]`."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + (time.perf_counter() - start)


def profile_layer(before: np.ndarray, after: np.ndarray, received: np.ndarray | None, radius: float,
                  gw_starts: str, backend: str, threads: int) -> dict:
    """One layer's statistics {statistic: {geometry: work}}, "gw_start", "intrinsic_dim" and "timings"."""
    seconds: dict[str, float] = {}
    stats: dict[str, dict[str, float]] = {s: {} for s in STATISTICS}
    gw_start = {}
    with _timed(seconds, "distances"):
        dist = {g: [pairwise_distances(x, g, radius) for x in (before, after)] for g in GEOMETRIES}
    for g in GEOMETRIES:
        with _timed(seconds, "shift"):
            stats["shift"][g] = shift(before, after, g, radius)
        with _timed(seconds, "gw"):
            stats["gw"][g], gw_start[g] = gromov_wasserstein_starts(*dist[g], gw_starts)
    with _timed(seconds, "topo"):
        diagrams = {g: [h1_diagram(d, threads, backend) for d in dist[g]] for g in ("raw", "spherical")}
        diagrams["hyperbolic"] = [angle_to_poincare(dgm, radius) for dgm in diagrams["spherical"]]
    with _timed(seconds, "topo_w2"):
        for g in GEOMETRIES:
            stats["topo"][g] = diagram_w2(*diagrams[g])
    seconds["topo"] += seconds["topo_w2"]
    with _timed(seconds, "intrinsic_dim"):
        # on what the FFN itself receives (after a pre-norm's gains, for llama blocks), not the bare stream
        angles = dist["spherical"][0] if received is None else pairwise_distances(received, "spherical", radius)
        dim = twonn_dimension(angles)
    return {"stats": stats, "gw_start": gw_start, "intrinsic_dim": dim if np.isfinite(dim) else None,
            "timings": seconds}


def profile_clouds(clouds: TokenClouds, cfg: AllocationConfig, sensitivity: list[float] | None = None) -> dict:
    """JSON-able profile: {"layers", "n_tokens", "d_model", "hyperbolic_radius", "stats": {statistic: {geometry:
    [per-layer work]}}, "intrinsic_dim", "sensitivity", ..., "timings": {phase: seconds summed over layers, "topo"
    including its part "topo_w2"}, "methods"}."""
    radius = cfg.hyperbolic_radius
    layers = clouds.layers
    backend = vr_backend(cfg.vr_backend)
    wall = time.perf_counter()
    pool, threads = _executor(cfg.diagram_workers, clouds.n_tokens, layers)
    run = functools.partial(profile_layer, radius=radius, gw_starts=cfg.gw_starts, backend=backend, threads=threads)
    received = [None] * layers if clouds.received is None else clouds.received
    with pool or nullcontext():
        results = list((pool.map if pool else map)(run, clouds.before, clouds.after, received))
    timings: Counter[str] = Counter()  # update adds each layer's seconds
    for result in results:
        timings.update(result["timings"])
    timings["wall"] = time.perf_counter() - wall
    stats = {s: {g: [r["stats"][s][g] for r in results] for g in GEOMETRIES} for s in STATISTICS}
    return {"layers": layers, "n_tokens": clouds.n_tokens, "d_model": int(clouds.before.shape[2]),
            "hyperbolic_radius": radius, "n_sequences": clouds.n_sequences, "stats": stats,
            "gw_start": {g: [r["gw_start"][g] for r in results] for g in GEOMETRIES}, "gw_starts": cfg.gw_starts,
            "vr_backend": backend, "intrinsic_dim": [r["intrinsic_dim"] for r in results],
            "sensitivity": None if sensitivity is None else [float(s) for s in sensitivity],
            "sensitivity_eps": cfg.sensitivity_eps if sensitivity is not None else None, "timings": dict(timings),
            "methods": METHODS}
