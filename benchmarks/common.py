"""What every figure shares: oriented rows, the machine they ran on, interleaved median timing.

Stdlib only at import: `python -m benchmarks --gpu` must start on a machine that has nothing but torch.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

BETTER = ("higher", "lower")


def row(name: str, ours: float, peer: float | None, units: str, better: str, **extra) -> dict:
    """One figure. `ratio` is how many times better ours is (> 1: we win), whichever way `better` points."""
    if better not in BETTER:
        raise ValueError(f"better={better!r}: use one of {BETTER}")
    ratio = None
    if peer is not None and ours and peer:
        ratio = ours / peer if better == "higher" else peer / ours
    return {"name": name, "ours": ours, "peer": peer, "ratio": ratio, "units": units, "better": better, **extra}


def unavailable(name: str, reason: str) -> dict:
    """A figure that could not run here, said as a row rather than a traceback."""
    return {"name": name, "ours": None, "peer": None, "ratio": None, "units": None, "status": "unavailable",
            "reason": reason}


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    """CPU model, cores, torch version and threads, and the accelerator when there is one."""
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version()}
    try:
        import torch
    except ImportError:
        return {**info, "torch": None, "device": "cpu"}
    info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                torch_default_threads=default_threads(), device="cpu")
    if torch.cuda.is_available():
        info.update(device="cuda", gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


@functools.lru_cache(maxsize=1)
def default_threads() -> int:
    """torch's intra-op thread count before the harness sets its own (call it first)."""
    import torch

    return torch.get_num_threads()


def load_average() -> float:
    """1-minute load average: on a shared machine, the other work every figure competed with."""
    return round(os.getloadavg()[0], 2)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each candidate, `rounds` samples each after `warmup` untimed calls.

    The order alternates every round (A B, then B A), so a burst of other load on a shared machine lands on every
    candidate alike; compare medians.
    """
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def spread(samples: list[float]) -> float:
    """Interquartile range over the median: how noisy a candidate's samples were."""
    if len(samples) < 4:
        return (max(samples) - min(samples)) / statistics.median(samples)
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / statistics.median(samples)
