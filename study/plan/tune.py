"""The tuning stage: each variant's peak LR chosen from short runs over a grid of multiples of the recipe's LR.

An experiment declares `tune: {lr: [0.25, 0.5, 1, 2, 4], scale: 113M, seeds: [0]}`. The planner adds one tune run
per variant x multiple x seed at the tune scale (the scale's recipe, at `multiple x` its peak LR), and holds every
main run of the variant until its tune runs have finished. Then, per variant:

- the grid's best point is the multiple with the lowest mean final validation loss over the tune seeds;
- when it lies at an edge of the grid, the next multiple in that direction (the edge's own spacing) joins the grid,
  up to `extend` points per direction, instead of taking the edge; past the cap the edge is taken, and said so;
- otherwise the chosen multiple is the minimum of the quadratic in log LR through the best point and its two
  neighbours (the best point itself when that parabola opens downward), inside their span.

The choice is made once, recorded in `<runs>/<experiment>/_tune/<variant>.json`, and written into the variant's
main-run specs; a record that exists is read, never recomputed. Other scales take the tuned multiple of the recipe's
LR rule (the transfer assumption the report states); with two or more tune scales, log LR* is fitted linearly
against log N (the scales' budgets) and read at each scale's budget instead.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from study.errors import StudyError

DEFAULT_EXTEND = 2
"""Grid points added beyond an edge, per direction, unless `tune.extend` says otherwise."""
INTERIOR, EXTENDED, EDGE = "interior", "extended", "edge"


@dataclass(frozen=True)
class Tuning:
    """An experiment's `tune:` block."""

    lr: tuple[float, ...]
    """Multiples of the recipe's peak LR, ascending."""
    scales: tuple[str, ...]
    """Scales the tune runs train at (`scale: S`, or `scales: [...]` to fit the optimum against N)."""
    seeds: tuple[int, ...]
    """Seeds of each tune point."""
    extend: int = DEFAULT_EXTEND
    """Most points added beyond an edge of the grid, per direction."""

    def identity(self) -> dict[str, Any]:
        """What a tuned main run's key hashes of its tuning."""
        return {"lr": list(self.lr), "scales": list(self.scales), "seeds": list(self.seeds), "extend": self.extend}


def parse_tuning(raw: Any, where: str, scale_exists) -> Tuning:
    """The `tune:` block, checked: every refusal names its field and the fix."""
    if not isinstance(raw, dict):
        raise StudyError(where, "must be a mapping", "write e.g. `tune: {lr: [0.25, 0.5, 1, 2, 4], scale: 113M, seeds: [0]}`")
    unknown = sorted(set(raw) - {"lr", "scale", "scales", "seeds", "extend"})
    if unknown:
        raise StudyError(f"{where}.{unknown[0]}", "is not a tuning key", "use lr, scale (or scales), seeds, extend")
    lr = raw.get("lr")
    if (not isinstance(lr, list) or len(lr) < 3 or any(isinstance(m, bool) or not isinstance(m, (int, float))
                                                       or not math.isfinite(m) or m <= 0 for m in lr)
            or len(set(lr)) != len(lr)):
        raise StudyError(f"{where}.lr", f"{lr!r} is not a list of three or more distinct positive multiples",
                         "list multiples of the recipe's peak LR, e.g. [0.25, 0.5, 1, 2, 4]")
    if ("scale" in raw) == ("scales" in raw):
        raise StudyError(f"{where}.scale", "give one tune scale (`scale: 113M`) or a list (`scales: [113M, 256M]`)",
                         "set exactly one of scale and scales")
    scales = [raw["scale"]] if "scale" in raw else raw["scales"]
    if not isinstance(scales, list) or not scales or any(not isinstance(s, str) for s in scales) or (
            "scales" in raw and len(set(scales)) < 2):
        raise StudyError(f"{where}.{'scale' if 'scale' in raw else 'scales'}", f"{scales!r} names no tune scale"
                         + (" (a list needs two or more to fit against N)" if "scales" in raw else ""),
                         "name scale presets of sweeps/scale/")
    for s in scales:
        scale_exists(s)
    seeds = raw.get("seeds", [0])
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)):
        raise StudyError(f"{where}.seeds", f"{seeds!r} is not a list of distinct non-negative integers",
                         "e.g. seeds: [0]")
    extend = raw.get("extend", DEFAULT_EXTEND)
    if isinstance(extend, bool) or not isinstance(extend, int) or not 0 <= extend <= 8:
        raise StudyError(f"{where}.extend", f"{extend!r} is not a number of points from 0 to 8",
                         f"e.g. extend: {DEFAULT_EXTEND}")
    return Tuning(tuple(sorted(float(m) for m in lr)), tuple(scales), tuple(seeds), extend)


@dataclass
class Point:
    multiple: float
    """LR multiple of the recipe's peak."""
    losses: list[float | None]
    """Final validation loss per tune seed (None: not finished)."""
    extension: bool = False
    """Added beyond an edge of the declared grid."""

    @property
    def mean(self) -> float | None:
        done = [x for x in self.losses if x is not None]
        return sum(done) / len(done) if len(done) == len(self.losses) and done else None


@dataclass
class Choice:
    """What a variant's tuning found at one scale."""

    multiple: float
    """The chosen multiple of the recipe's peak LR."""
    status: str
    """`interior` (the grid's best point had a neighbour on each side), `extended` (it did after adding points
    beyond an edge) or `edge` (still at an edge when the cap was reached: the edge is taken)."""
    best: float
    """The grid point with the lowest mean loss."""
    points: list[Point] = field(default_factory=list)
    """Every point the choice read."""


def grid_with_extensions(tuning: Tuning, results: dict[float, Point]) -> tuple[list[Point], bool]:
    """The points to train (declared and added) and whether they decide the choice: extensions are added while
    the best finished point sits at an edge and the cap allows, one point at a time, once every point is in."""
    points = [results.get(m) or Point(m, [None] * len(tuning.seeds)) for m in tuning.lr]
    added = {"low": 0, "high": 0}
    while True:
        if any(p.mean is None for p in points):
            return points, False
        best = min(range(len(points)), key=lambda i: (points[i].mean, i))
        if 0 < best < len(points) - 1:
            return points, True
        side = "low" if best == 0 else "high"
        if added[side] >= tuning.extend:
            return points, True
        edge, inner = (points[0], points[1]) if side == "low" else (points[-1], points[-2])
        nxt = _round(edge.multiple * edge.multiple / inner.multiple)
        point = results.get(nxt) or Point(nxt, [None] * len(tuning.seeds))
        point.extension = True
        points = [point, *points] if side == "low" else [*points, point]
        added[side] += 1


def choose(points: list[Point], extended: bool) -> Choice:
    """The chosen multiple from finished points (see the module docstring)."""
    means = [p.mean for p in points]
    best = min(range(len(points)), key=lambda i: (means[i], i))
    if best in (0, len(points) - 1):
        return Choice(points[best].multiple, EDGE, points[best].multiple, points)
    x = [math.log(points[i].multiple) for i in (best - 1, best, best + 1)]
    y = [means[i] for i in (best - 1, best, best + 1)]
    # the parabola through three points: its vertex, when it opens upward
    d1, d2 = (y[1] - y[0]) / (x[1] - x[0]), (y[2] - y[1]) / (x[2] - x[1])
    curvature = (d2 - d1) / (x[2] - x[0])
    vertex = x[1] if curvature <= 0 else (x[0] + x[1]) / 2 - d1 / (2 * curvature)
    chosen = _round(math.exp(min(max(vertex, x[0]), x[2])))
    return Choice(chosen, EXTENDED if extended else INTERIOR, points[best].multiple, points)


def _round(multiple: float) -> float:
    """Multiples as the planner writes them: 6 significant digits, so a grid read back from a record matches."""
    return float(f"{multiple:.6g}")


def transfer(choices: dict[str, tuple[float, float]], budgets: dict[str, int], scale: str, rule_lr: float,
             ) -> tuple[float, str]:
    """(peak LR, how it was found) at `scale` from the tune scales' choices {scale: (multiple, tuned LR)}: the
    scale's own choice, the tuned multiple of the recipe's rule (one tune scale), or log LR* fitted against log N."""
    if len(choices) == 1:
        tuned_at, (multiple, _) = next(iter(choices.items()))
        how = "tuned" if tuned_at == scale else f"tuned at {tuned_at}, transferred as a multiple of the LR rule"
        return rule_lr * multiple, f"x{multiple:g} of the recipe's LR ({how})"
    import numpy as np

    logn = np.log([budgets[s] for s in choices])
    loglr = np.log([lr for _, lr in choices.values()])
    slope, intercept = np.polyfit(logn, loglr, 1)
    lr = float(math.exp(intercept + slope * math.log(budgets[scale])))
    return lr, f"log LR* = {intercept:.3f} + {slope:.3f} log N fitted on {', '.join(choices)}"


def record_path(runs_root: str, experiment: str, variant: str) -> Path:
    return Path(runs_root) / experiment / "_tune" / f"{variant}.json"


def read_record(path: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """A variant's recorded choices, when recorded for this tuning (another grid's record is not this one's)."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if record.get("identity") == identity else None


def write_record(path: Path, identity: dict[str, Any], choices: dict[str, Choice]) -> dict[str, Any]:
    """Record the choices once (atomically); returns the record."""
    record = {"identity": identity, "scales": {s: asdict(c) for s, c in choices.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return record
