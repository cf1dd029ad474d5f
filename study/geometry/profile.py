"""The work profile of a model: every statistic under every geometry, layer by layer (study 2, step 3).

Per layer, the six distance matrices (before/after x raw/spherical/hyperbolic) are computed once and shared by the
statistics that need them. Persistence diagrams cost one Vietoris-Rips run per cloud for raw and one for spherical:
the hyperbolic distance is an increasing function of the angle (`angle_to_poincare`), the filtration order is
therefore the same, and the hyperbolic diagram is the spherical one with its birth and death values mapped.
Diagram distances are single-threaded, so they run last, spread over worker processes, once the main process
(whose Vietoris-Rips and BLAS calls are multi-threaded) is done: running both at once oversubscribes the cores, and
GW's BLAS calls ran up to 50x slower that way on 2 cores.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Executor, Future
from contextlib import contextmanager

import numpy as np

from study.config.geometry import STATISTICS, AllocationConfig
from study.geometry.clouds import TokenClouds
from study.geometry.geometries import GEOMETRIES, angle_to_poincare, pairwise_distances
from study.geometry.work import (gromov_wasserstein_starts, h1_diagram, shift, timed_diagram_w2, twonn_dimension,
                                 vr_backend)

METHODS = {
    "shift": "mean distance between corresponding tokens",
    "gw": "GW_2 = 0.5 sqrt(min GW loss), POT conditional gradient from the identity coupling and from POT's default "
    "(product) start, the lower kept (gw_start says which), uniform weights, both matrices divided by the larger "
    "mean distance and the result scaled back",
    "topo": "exact W_2 (L2 ground metric, POT network simplex) between H1 Vietoris-Rips diagrams (Ripser's "
    "algorithm, full filtration; vr_backend names the implementation)",
    "intrinsic_dim": "TwoNN (Facco et al. 2017, 10% discarded) on angular distances of the cloud the FFN receives "
    "(after the block's pre-norm, gains included, where it has one)",
    "sensitivity": "(L(1+eps) + L(1-eps)) / 2 - L(1), FFN branch scaled by 1 +- eps",
}


class _Inline(Executor):
    """Runs each task at submission: the profile's code path without worker processes."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def _cores() -> int:
    # The affinity mask, not os.cpu_count(): under SLURM it is the job's allocation, not the whole node.
    return len(os.sched_getaffinity(0))


# Below this many tokens a diagram distance takes milliseconds and starting worker processes costs seconds.
POOL_MIN_TOKENS = 512


def _executor(workers: int, n_tokens: int) -> Executor:
    if workers == -1:
        workers = _cores()
    if workers <= 1 or n_tokens < POOL_MIN_TOKENS:
        return _Inline()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the caller has usually loaded torch and its thread pools, which fork does not copy safely.
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def profile_clouds(clouds: TokenClouds, cfg: AllocationConfig, sensitivity: list[float] | None = None) -> dict:
    """JSON-able profile: {"layers", "n_tokens", "d_model", "hyperbolic_radius", "stats": {statistic: {geometry:
    [per-layer work]}}, "intrinsic_dim", "sensitivity", "sensitivity_eps", "timings": {stage: seconds}, "methods"}.

    Timings: seconds spent per stage summed over layers; "topo" includes the diagram distances' seconds in worker
    processes ("topo_w2", a part of "topo"), so with several workers the stages can sum to more than "wall".
    """
    radius = cfg.hyperbolic_radius
    layers = clouds.layers
    stats = {s: {g: [0.0] * layers for g in GEOMETRIES} for s in STATISTICS}
    gw_start = {g: [""] * layers for g in GEOMETRIES}
    intrinsic_dim = []
    timer = _Timer()
    wall = time.perf_counter()
    diagrams: dict[tuple[int, str], list[np.ndarray]] = {}
    threads = _cores()
    backend = vr_backend(cfg.vr_backend)
    for layer in range(layers):
        clouds_ = (clouds.before[layer], clouds.after[layer])
        with timer("distances"):
            dist = {g: [pairwise_distances(x, g, radius) for x in clouds_] for g in GEOMETRIES}
        for g in GEOMETRIES:
            with timer("shift"):
                stats["shift"][g][layer] = shift(*clouds_, g, radius)
            with timer("gw"):
                stats["gw"][g][layer], gw_start[g][layer] = gromov_wasserstein_starts(*dist[g])
        with timer("topo"):
            for g in ("raw", "spherical"):
                diagrams[layer, g] = [h1_diagram(d, threads, backend) for d in dist[g]]
            diagrams[layer, "hyperbolic"] = [angle_to_poincare(dgm, radius) for dgm in diagrams[layer, "spherical"]]
        with timer("intrinsic_dim"):
            # on what the FFN itself receives (after a pre-norm's gains, for llama blocks), not the bare stream
            received = dist["spherical"][0] if clouds.received is None else pairwise_distances(
                clouds.received[layer], "spherical", radius)
            dim = twonn_dimension(received)
            intrinsic_dim.append(dim if np.isfinite(dim) else None)
    with _executor(cfg.diagram_workers, clouds.n_tokens) as pool:
        futures = {key: pool.submit(timed_diagram_w2, *pair) for key, pair in diagrams.items()}
        for (layer, g), future in futures.items():
            stats["topo"][g][layer], seconds = future.result()
            timer.add("topo", seconds)
            timer.add("topo_w2", seconds)
    timer.add("wall", time.perf_counter() - wall)
    return {
        "layers": layers,
        "n_tokens": clouds.n_tokens,
        "d_model": int(clouds.before.shape[2]),
        "hyperbolic_radius": radius,
        "n_sequences": clouds.n_sequences,
        "stats": stats,
        "gw_start": gw_start,
        "vr_backend": backend,
        "intrinsic_dim": intrinsic_dim,
        "sensitivity": None if sensitivity is None else [float(s) for s in sensitivity],
        "sensitivity_eps": cfg.sensitivity_eps if sensitivity is not None else None,
        "timings": timer.seconds,
        "methods": METHODS,
    }
