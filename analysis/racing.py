"""Racing's decisions: at each decay-branch point (a *rung*) the arms still racing are decided on their branch
endpoints as the final comparison is decided, Holm over the arms still racing at the rung's share of alpha; an arm
decided worse (also equivalent, with ``stop_equivalent``) stops at that scale. One :class:`RungVerdict` per verdict
and stop, a line of ``_launch/racing.jsonl``; :func:`race_record` is the MLflow record (:func:`read_race` reads it
back); :func:`decide_ready` is what the launch calls (:mod:`study.launch.racing`). Rungs and costs:
:mod:`study.plan.racing`; why the error rate holds: analysis/README.md ("Racing"). No MLflow or torch at import;
pandas and scipy are imported where a rung is decided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from analysis.records import JsonRecord, latest_record
from study.config.decision import DecisionRule
from study.config.run import Role
from study.errors import StudyError
from study.files import COUNT, FLAG, NUMBER, TEXT, optional, shape_problem
from study.plan.racing import RHO, RunCost, rung_of, rungs, saved_by_stop
from study.schema import ROLE_RACING

if TYPE_CHECKING:
    import pandas as pd

    from analysis.decide import Decision


@dataclass(frozen=True)
class RungVerdict(JsonRecord):
    """One (variant, scale) decided at one rung, and whether it stops there: the one record of a verdict and a stop."""

    variant: str
    scale: str
    baseline: str
    rung: int
    """Rung index (0: the smallest branch point)."""
    at: float
    """Branch point, as a fraction of the run's planned tokens."""
    verdict: str
    """better, worse, equivalent or undecided, at this rung's alpha with Holm over the arms still racing."""
    n: int
    """Seed pairs."""
    mean_delta: float
    """Mean of variant - baseline at this branch point."""
    ci_low: float
    """ci_low and ci_high: the paired t interval at 1 - alpha (this rung's alpha)."""
    ci_high: float
    alpha: float
    """Alpha spent at this rung."""
    stops: bool
    """The arm stops here: its trunks are cancelled and no later branch trains (never at the last rung)."""
    gpu_hours_saved: float | None = None
    """A stop's GPU-hours not trained, over its seeds' runs (:func:`hours_saved`); None until costed, or no stop."""
    decision: Decision | None = None
    """The full decision row at this rung; None for a verdict read back from its line."""

    def line(self) -> dict:
        """The verdict as racing.jsonl and the race's MLflow record keep it: every field but the decision row."""
        return {k: v for k, v in self.to_dict().items() if k != "decision"}

    @classmethod
    def from_line(cls, line: Mapping[str, Any]) -> "RungVerdict":
        """The verdict of a line :func:`line_problem` passed (an older line without ``gpu_hours_saved``: None)."""
        return cls(**{k: line[k] for k in _LINE_FIELDS if k in line})


_LINE_FIELDS = tuple(name for name in RungVerdict.__dataclass_fields__ if name != "decision")

_LINE = {"at": NUMBER, "variant": optional(TEXT), "scale": optional(TEXT), "stops": FLAG, "verdict": TEXT}
_STOP_LINE = {"variant": TEXT, "scale": TEXT, "baseline": TEXT, "rung": COUNT, "n": COUNT, "mean_delta": NUMBER,
              "ci_low": NUMBER, "ci_high": NUMBER, "alpha": NUMBER}
"""The fields every line of racing.jsonl holds (a rung passed with no arm left racing has no variant), and those of
a verdict that stops its arm, which the launch and ``study status`` read."""

RACE_ARTIFACT = "race_record.json"
"""Artifact of the experiment's MLflow ``racing`` run that holds :func:`race_record`."""

RACE_ARTIFACT_BEFORE = "racing.json"
"""That artifact's name before the rename (the launch's roster shares it): the report still reads it in older stores."""

PASSED = "none racing"
"""The verdict of a rung's line when every arm had stopped before it: the rung is passed, and counts as decided."""


def line_problem(line: Any) -> str:
    """What keeps ``line`` from being a verdict's line of racing.jsonl; '' when nothing does."""
    return (shape_problem(line, _LINE, present={"gpu_hours_saved": optional(NUMBER)})
            or (shape_problem(line, _STOP_LINE) if line["stops"] else ""))


def decide_rung(endpoints: pd.DataFrame, baseline: str, at: float, planned: Sequence[float], rule: DecisionRule,
                stop_equivalent: bool = False, stopped: Iterable[tuple[str, str]] = (), rho: float = RHO
                ) -> list[RungVerdict]:
    """Verdicts at the rung ``at`` for every (variant, scale) still racing, and which of them stop.

    ``endpoints``: one row per finished branch, columns ``variant``, ``scale``, ``seed``, ``at`` and ``rule.metric``
    (the rest pairing reads is filled in: every row counts as finished). ``planned``: every branch point (they fix
    this rung's alpha); ``stopped``: the arms stopped at an earlier rung, neither decided again nor in the family.
    """
    from analysis.decide import decide
    from analysis.paired import paired_deltas

    rung = rung_of(at, planned, rule.alpha, rho)
    missing = sorted({"variant", "scale", "seed", "at", rule.metric} - set(endpoints.columns))
    if missing:
        raise StudyError("endpoints", f"lack the column(s) {', '.join(missing)}",
                         "pass one row per branch endpoint with variant, scale, seed, at and the decision metric")
    stopped = {(str(v), str(s)) for v, s in stopped}
    here = np.isclose(endpoints["at"].to_numpy(float), rung.at, rtol=1e-9, atol=1e-12)
    keep = [ok and (v == baseline or (v, s) not in stopped)
            for ok, v, s in zip(here, endpoints["variant"], endpoints["scale"])]
    frame = endpoints[keep]
    if frame.empty or baseline not in set(frame["variant"]):
        return []
    frame = frame.assign(**{column: value for column, value in _PAIRING_DEFAULTS.items()
                            if column not in frame.columns})
    if "run_id" not in endpoints.columns:
        frame = frame.assign(run_id=[f"{v}-{s}-s{seed}-at{rung.at:g}"
                                     for v, s, seed in zip(frame["variant"], frame["scale"], frame["seed"])])
    results = paired_deltas(frame, rule.metric, baseline, n_resamples=0)
    decisions = decide({rule.metric: results}, rule, alpha=rung.alpha)
    stopping = ("worse", "equivalent") if stop_equivalent else ("worse",)
    return [RungVerdict(variant=d.variant, scale=d.scale, baseline=baseline, rung=rung.index, at=rung.at,
                        verdict=d.verdict, n=d.n, mean_delta=d.mean_delta, ci_low=d.ci_low, ci_high=d.ci_high,
                        alpha=rung.alpha, stops=d.verdict in stopping and not rung.last, decision=d)
            for d in decisions]


_PAIRING_DEFAULTS = {"status": "FINISHED", "run_key": None, "start_time": 0, "failure_reason": None,
                     "params_counted": math.nan}
"""What pairing reads besides the endpoints' own columns, for rows that do not come from the run table."""


def race(endpoints: pd.DataFrame, baseline: str, planned: Sequence[float], rule: DecisionRule,
         stop_equivalent: bool = False, rho: float = RHO) -> list[RungVerdict]:
    """Every rung the endpoints reach, in order, each decided on the arms still racing after the rungs before it."""
    verdicts: list[RungVerdict] = []
    stopped: set[tuple[str, str]] = set()
    for rung in rungs(planned, rule.alpha, rho):
        here = decide_rung(endpoints, baseline, rung.at, planned, rule, stop_equivalent, stopped, rho)
        verdicts += here
        stopped |= {(v.variant, v.scale) for v in here if v.stops}
    return verdicts


def stops(verdicts: Iterable[RungVerdict]) -> list[RungVerdict]:
    """The verdicts that stop their arm, in rung order."""
    return sorted((v for v in verdicts if v.stops), key=lambda v: (v.rung, v.scale, v.variant))


def hours_saved(found: Iterable[RungVerdict], costs: Mapping[tuple[str, str, int], RunCost]) -> list[RungVerdict]:
    """Each stop with the GPU-hours its arm did not train, over every seed's run (``costs`` by variant, scale, seed)."""
    out = []
    for stop in found:
        seeds = [c for (v, s, _), c in costs.items() if (v, s) == (stop.variant, stop.scale)]
        out.append(replace(stop, gpu_hours_saved=float(sum(saved_by_stop(c, stop.rung) for c in seeds))))
    return out


def decide_ready(roster: Mapping[str, Any], done: Sequence[Mapping[str, Any]],
                 endpoint: Callable[[str], float | None]) -> list[dict]:
    """The lines of every rung that is ready and not yet decided, in rung order.

    ``roster`` is :func:`study.launch.racing.write_roster`'s, ``done`` the lines so far, ``endpoint`` a branch's final
    decision metric by run key (None while unfinished or diverged). A rung is ready once every branch of the arms
    still racing has its endpoint and every rung before it is decided; one with no arm left is :data:`PASSED`.
    """
    import pandas as pd

    rule = DecisionRule(**roster["decision"])
    rungs_done = {v["at"] for v in done}
    stopped = {(v["variant"], v["scale"]) for v in done if v["stops"]}
    branches = [r for r in roster["runs"] if r["role"] == Role.branch.value]
    new: list[dict] = []
    for at in sorted(roster["at"]):
        if at in rungs_done:
            continue
        here = [r for r in branches if r["at"] == at and (r["variant"], r["scale"]) not in stopped]
        values = {r["key"]: endpoint(r["key"]) for r in here}
        if not here or any(v is None for v in values.values()):
            break  # rungs are decided in order: a later one waits for this one
        endpoints = pd.DataFrame([{"variant": r["variant"], "scale": r["scale"], "seed": r["seed"], "at": at,
                                   "run_key": r["key"], rule.metric: values[r["key"]]} for r in here])
        verdicts = decide_rung(endpoints, roster["baseline"], at, roster["at"], rule, roster["stop_equivalent"],
                               stopped)
        lines = [v.line() for v in verdicts] or [{"at": at, "variant": None, "scale": None, "stops": False,
                                                  "verdict": PASSED}]
        new += lines
        stopped |= {(v.variant, v.scale) for v in verdicts if v.stops}
    return new


def race_record(roster: Mapping[str, Any], lines: Sequence[Mapping[str, Any]]) -> dict:
    """The race's MLflow record: every line, and each stop with the GPU-hours its arm did not train (the roster's
    planned hours of each trunk, split at its branch starts in proportion to steps, and of each branch)."""
    costs = {}
    for trunk in (r for r in roster["runs"] if r["role"] == Role.trunk.value):
        mine = sorted((r for r in roster["runs"] if r.get("trunk") == trunk["key"]), key=lambda r: r["at"])
        starts, hours = trunk["starts"], trunk["gpu_hours"] or 0.0
        segments = tuple(hours * (s - b) / starts[-1] for s, b in zip(starts, [0, *starts[:-1]]))
        costs[(trunk["variant"], trunk["scale"], trunk["seed"])] = RunCost(
            segments, tuple(r["gpu_hours"] or 0.0 for r in mine))
    found = [RungVerdict.from_line(v) for v in lines if v["stops"]]
    return {"baseline": roster["baseline"], "at": roster["at"], "stop_equivalent": roster["stop_equivalent"],
            "verdicts": list(lines), "stops": [s.line() for s in hours_saved(found, costs)]}


def read_race(client, experiment_id: str) -> dict | None:
    """The race's record (under its old name in older stores); None when the experiment never raced."""
    for artifact in (RACE_ARTIFACT, RACE_ARTIFACT_BEFORE):
        record = latest_record(client, experiment_id, ROLE_RACING, artifact)
        if record is not None:
            return record
    return None
