"""Tuning: each variant's peak LR chosen from short runs over a grid of multiples of the recipe's LR.

`tune: {lr: [0.25, 0.5, 1, 2, 4], scale: 113M, seeds: [0]}` adds one tune run per variant x multiple x seed at the
tune scale and holds the variant's main runs until they finish. The best point is the multiple with the lowest mean
final validation loss; at an edge of the grid the next multiple beyond it (the edge's spacing) joins, up to `extend`
per direction, after which the edge is taken; otherwise the choice is the vertex of the parabola in log LR through
the best point and its neighbours. A diverged point counts as the worst loss; a grid diverged everywhere decides
nothing. The choice is recorded once, in `<runs>/<experiment>/_tune/<variant>.json`, and used only while it names the
plan's tune runs (a main run's key includes their keys), their results are all present and equal its losses, and its
choice follows from them; a damaged record is refused, naming the file. Other scales take the tuned multiple of the
recipe's LR rule, or with two or more tune scales log LR* fitted linearly against log N (the budgets).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from study.config.validate import SEED_MAX, is_number, refuse_unknown
from study.errors import StudyError
from study.files import LARGEST, read_json, replace_file

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
        raise StudyError(where, "must be a mapping",
                         "write e.g. `tune: {lr: [0.25, 0.5, 1, 2, 4], scale: 113M, seeds: [0]}`")
    refuse_unknown(raw, ("lr", "scale", "scales", "seeds", "extend"), where, "a tuning key",
                   "use lr, scale (or scales), seeds, extend")
    lr = raw.get("lr")
    if not isinstance(lr, list) or len(lr) < 3 or not all(map(_number, lr)) or len(set(lr)) != len(lr):
        raise StudyError(f"{where}.lr", f"{lr!r} is not a list of three or more distinct positive multiples",
                         "list multiples of the recipe's peak LR, e.g. [0.25, 0.5, 1, 2, 4]")
    if ("scale" in raw) == ("scales" in raw):
        raise StudyError(f"{where}.scale", "give one tune scale (`scale: 113M`) or a list (`scales: [113M, 256M]`)",
                         "set exactly one of scale and scales")
    listed = "scales" in raw
    scales = raw["scales"] if listed else [raw["scale"]]
    if not isinstance(scales, list) or not scales or any(not isinstance(s, str) for s in scales) or (
            listed and len(set(scales)) < 2):
        raise StudyError(f"{where}.{'scales' if listed else 'scale'}", f"{scales!r} names no tune scale"
                         + (" (a list needs two or more to fit against N)" if listed else ""),
                         "name scale presets of sweeps/scale/")
    for s in scales:
        try:
            scale_exists(s)
        except StudyError as err:
            raise StudyError(f"{where}.{'scales' if listed else 'scale'}", err.problem, err.fix) from None
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise StudyError(f"{where}.seeds", f"{seeds!r} is not a list of distinct non-negative integers",
                         "e.g. seeds: [0]")
    if max(seeds) > SEED_MAX:
        raise StudyError(f"{where}.seeds", f"{max(seeds)} is past the largest seed torch takes",
                         "use seeds below 2**64")
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
    """Final validation loss per tune seed (None: not finished; inf: diverged)."""
    extension: bool = False
    """Added beyond an edge of the declared grid."""
    keys: list[str] = field(default_factory=list)
    """Run key of each tune seed's run (what the record names)."""

    @property
    def mean(self) -> float | None:
        """Mean final loss over the tune seeds once all have settled; inf when any diverged (the worst loss)."""
        done = [x for x in self.losses if x is not None]
        return sum(done) / len(done) if len(done) == len(self.losses) and done else None


@dataclass
class Choice:
    """What a variant's tuning found at one scale."""

    multiple: float
    """The chosen multiple of the recipe's peak LR."""
    status: str
    """`interior` (the best point had a neighbour on each side), `extended` (after adding points beyond an edge) or
    `edge` (still at an edge when the cap was reached)."""
    best: float
    """The grid point with the lowest mean loss."""
    points: list[Point] = field(default_factory=list)
    """Every point the choice read."""


def grid_with_extensions(tuning: Tuning, results: dict[float, Point]) -> tuple[list[Point], bool]:
    """The points to train (declared and added) and whether they decide the choice: once every point is in, one
    point is added beyond an edge at a time while the best point sits there and the cap allows."""
    def point(multiple: float) -> Point:
        return results.get(multiple) or Point(multiple, [None] * len(tuning.seeds))

    points = [point(m) for m in tuning.lr]
    added = {"low": 0, "high": 0}
    while True:
        if any(p.mean is None for p in points):
            return points, False
        best = _best(points)
        side = "low" if best == 0 else "high"
        if 0 < best < len(points) - 1 or added[side] >= tuning.extend:  # interior, or capped at an edge
            return points, True
        edge, inner = (points[0], points[1]) if side == "low" else (points[-1], points[-2])
        nxt = point(_round(edge.multiple * edge.multiple / inner.multiple))
        nxt.extension = True
        points = [nxt, *points] if side == "low" else [*points, nxt]
        added[side] += 1


def choose(points: list[Point], extended: bool) -> Choice:
    """The chosen multiple from finished points (see the module docstring)."""
    best = _best(points)
    top = points[best].multiple
    if best in (0, len(points) - 1):
        return Choice(top, EDGE, top, points)
    status = EXTENDED if extended else INTERIOR
    x = [math.log(p.multiple) for p in points[best - 1:best + 2]]
    y = [p.mean for p in points[best - 1:best + 2]]
    if not all(map(math.isfinite, y)):  # a diverged neighbour bounds the optimum but gives no curve: the best point
        return Choice(top, status, top, points)
    # the parabola through three points: its vertex, when it opens upward
    d1, d2 = (y[1] - y[0]) / (x[1] - x[0]), (y[2] - y[1]) / (x[2] - x[1])
    curvature = (d2 - d1) / (x[2] - x[0])
    vertex = x[1] if curvature <= 0 else (x[0] + x[1]) / 2 - d1 / (2 * curvature)
    return Choice(_round(math.exp(min(max(vertex, x[0]), x[2]))), status, top, points)


def _best(points: list[Point]) -> int:
    """Index of the point with the lowest mean loss (the first of equals)."""
    return min(range(len(points)), key=lambda i: (points[i].mean, i))


def _round(multiple: float) -> float:
    """Multiples as the planner writes them: 6 significant digits, so a grid read back from a record matches."""
    return float(f"{multiple:.6g}")


def transfer(choices: dict[str, tuple[float, float]], budgets: dict[str, int], scale: str, rule_lr: float,
             ) -> tuple[float, str]:
    """(peak LR, how it was found) at `scale` from the tune scales' {scale: (multiple, tuned LR)}: the tuned multiple
    of the recipe's rule (one tune scale), or log LR* fitted against log N."""
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


def all_diverged(points: list[Point]) -> bool:
    """Every point of a decided grid diverged: no LR of it trains, so nothing can be chosen."""
    return all(p.mean is not None and not math.isfinite(p.mean) for p in points)


RECORD_VERSION = 2
"""Version of `_tune/<variant>.json` (1 named no tune runs: such a record is recomputed, never trusted)."""
_RECORD_KEYS = {"version", "identity", "scales"}
_CHOICE_KEYS = {"multiple", "status", "best", "points"}
_POINT_KEYS = {"multiple", "extension", "seeds", "keys", "losses"}
DIVERGED_LOSS = "diverged"
"""How the record writes a diverged tune run's loss (JSON has no infinity)."""


def record_path(runs_root: str, experiment: str, variant: str) -> Path:
    return Path(runs_root) / experiment / "_tune" / f"{variant}.json"


def confined(path: Path) -> Path:
    """The record's path, refused when its folder or the file is a symbolic link (never read or written through one)."""
    for p in (path.parent, path):
        if p.is_symlink():
            raise StudyError(str(p), "is a symbolic link: the tuning record is kept in the experiment's own runs "
                             "folder, never written or read through a link", f"replace {p} with a plain "
                             f"{'directory' if p == path.parent else 'file (or delete it)'}")
    return path


def _fix(path: Path) -> str:
    return f"delete {path}: the next `study launch` recomputes it from the finished tune runs"


def _damaged(path: Path, problem: str) -> StudyError:
    return StudyError(str(path), f"is not a tuning record this plan can use: {problem}", _fix(path))


def _number(x: Any) -> bool:
    """A positive finite number a record can hold (not past LARGEST)."""
    return is_number(x) and 0 < x <= LARGEST


def read_record(path: Path, tuning: Tuning, grid_keys: dict[str, dict[tuple[float, int], str]],
                result_of) -> tuple[dict[str, Choice] | None, str]:
    """A variant's recorded choices per tune scale, checked; or (None, why it is not used): it names other tune runs
    than `grid_keys[scale][(multiple, seed)]` (the plan's now), or one whose `result_of(key)` (its settled loss, inf
    when diverged) is None. A record whose shape, values, losses or choice do not hold is refused."""
    path = confined(path)
    if not path.exists():
        return None, ""
    record = read_json(path, _fix(path))  # a directory in its place too: a record is never written over one
    if not isinstance(record, dict):
        raise _damaged(path, "it is not a mapping")
    if record.get("version") != RECORD_VERSION:
        return None, f"{path} names no tune runs (an older record): it is recomputed from the current ones"
    if set(record) != _RECORD_KEYS:
        raise _damaged(path, f"its fields are {sorted(record)}, not {sorted(_RECORD_KEYS)}")
    if record["identity"] != tuning.identity():
        return None, f"{path} was recorded for another tune grid: it is recomputed from the current one"
    scales = record["scales"]
    if not isinstance(scales, dict) or set(scales) != set(tuning.scales):
        found = sorted(scales) if isinstance(scales, dict) else scales
        raise _damaged(path, f"it records scales {found}, the tuning is at {list(tuning.scales)}")
    choices = {}
    for scale in tuning.scales:
        choice = _recorded_choice(path, scale, scales[scale], tuning)
        recorded = {(p.multiple, seed): key for p in choice.points for seed, key in zip(tuning.seeds, p.keys)}
        if changed := sorted(k for k, key in grid_keys[scale].items() if recorded.get(k) != key):
            (m, seed) = changed[0]
            return None, (f"{path} was computed from other tune runs than the plan's (at {scale}, x{m:g} seed {seed} "
                          f"is {grid_keys[scale][m, seed]} now, {recorded.get((m, seed), 'absent')} in the record: "
                          "the experiment changed what they train)")
        gone = []
        for p in choice.points:
            for key, loss in zip(p.keys, p.losses):
                found = result_of(key)
                if found is None:
                    gone.append(key)
                elif found != loss:
                    raise _damaged(path, f"it records loss {loss} for tune run {key}, whose result.json says {found}")
        if gone:
            # a choice is only as good as the results it can be checked against: without them a consistent edit
            # would train the main runs at another LR under the same keys
            return None, (f"{path} names tune runs whose results are gone from their run directories ("
                          f"{', '.join(gone)}): the main runs wait while they train again, whose results then "
                          "check the record")
        again, decided = grid_with_extensions(tuning, {p.multiple: Point(p.multiple, list(p.losses))
                                                       for p in choice.points})
        if not decided or [p.multiple for p in again] != [p.multiple for p in choice.points] or all_diverged(again):
            raise _damaged(path, f"its points at {scale} do not decide the grid they record")
        expected = choose(again, any(p.extension for p in again))
        if (expected.multiple, expected.status, expected.best) != (choice.multiple, choice.status, choice.best):
            raise _damaged(path, f"its choice at {scale} (x{choice.multiple:g}, {choice.status}) does not follow "
                                 f"from its points (x{expected.multiple:g}, {expected.status})")
        choices[scale] = choice
    return choices, ""


def _recorded_choice(path: Path, scale: str, raw: Any, tuning: Tuning) -> Choice:
    where = f"scales.{scale}"
    if not isinstance(raw, dict) or set(raw) != _CHOICE_KEYS:
        raise _damaged(path, f"{where} must hold exactly {sorted(_CHOICE_KEYS)}")
    if not _number(raw["multiple"]) or not _number(raw["best"]):
        raise _damaged(path, f"{where}: multiple {raw['multiple']!r} and best {raw['best']!r} must be positive "
                             f"finite numbers up to {LARGEST:g}")
    if raw["status"] not in (INTERIOR, EXTENDED, EDGE):
        raise _damaged(path, f"{where}.status {raw['status']!r} is not one of {INTERIOR}, {EXTENDED}, {EDGE}")
    if not isinstance(raw["points"], list) or not raw["points"]:
        raise _damaged(path, f"{where}.points must list the grid's points")
    points = []
    for i, p in enumerate(raw["points"]):
        at = f"{where}.points[{i}]"
        if not isinstance(p, dict) or set(p) != _POINT_KEYS:
            raise _damaged(path, f"{at} must hold exactly {sorted(_POINT_KEYS)}")
        if not _number(p["multiple"]) or not isinstance(p["extension"], bool):
            raise _damaged(path, f"{at}: multiple {p['multiple']!r} must be a positive finite number up to "
                                 f"{LARGEST:g}")
        shaped = all(isinstance(p[k], list) and len(p[k]) == len(tuning.seeds) for k in ("keys", "losses"))
        if p["seeds"] != list(tuning.seeds) or not shaped or not all(isinstance(k, str) for k in p["keys"]):
            raise _damaged(path, f"{at} must give a key and a loss for each tune seed {list(tuning.seeds)}")
        if bad := [x for x in p["losses"] if x != DIVERGED_LOSS and not (is_number(x) and 0 <= x <= LARGEST)]:
            raise _damaged(path, f"{at}: loss {bad[0]!r} is neither a finite number from 0 to {LARGEST:g} nor "
                                 f"{DIVERGED_LOSS!r}")
        losses = [math.inf if x == DIVERGED_LOSS else float(x) for x in p["losses"]]
        points.append(Point(float(p["multiple"]), losses, p["extension"], list(p["keys"])))
    return Choice(float(raw["multiple"]), raw["status"], float(raw["best"]), points)


def write_record(path: Path, tuning: Tuning, choices: dict[str, Choice]) -> dict[str, Any]:
    """Record the choices and the tune runs they read, once (atomically); returns the record."""
    path = confined(path)

    def point(p: Point) -> dict[str, Any]:
        return {"multiple": p.multiple, "extension": p.extension, "seeds": list(tuning.seeds), "keys": list(p.keys),
                "losses": [DIVERGED_LOSS if not math.isfinite(x) else x for x in p.losses]}

    record = {"version": RECORD_VERSION, "identity": tuning.identity(),
              "scales": {s: {"multiple": c.multiple, "status": c.status, "best": c.best,
                             "points": [point(p) for p in c.points]} for s, c in choices.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    confined(path)
    replace_file(path, json.dumps(record, indent=1, allow_nan=False))
    return record
