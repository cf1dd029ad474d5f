"""Racing as a plan sees it: the `racing:` block, the rungs and the alpha each spends, what a branched run costs by
part, and the simulation of many races that prices racing in ``study plan`` (:func:`expected_saving`).

Numpy only at import (``study plan`` imports it); a race is decided with :mod:`study.plan.paired_t`, as the report
decides. How a rung is decided on a study's endpoints, and the stops, are in :mod:`analysis.racing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from study.config.validate import refuse_unknown
from study.errors import StudyError
from study.plan.paired_t import VERDICTS, holm, paired_t

if TYPE_CHECKING:
    from study.plan.branches import Branches


@dataclass(frozen=True)
class Racing:
    """The `racing:` block: arms decided at a branch point stop training (analysis.racing decides)."""

    stop_equivalent: bool = False
    """Also stop an arm decided equivalent to the baseline (within decision.margin), not only one decided worse."""


def parse_racing(raw: Any, where: str, branches: Branches | None) -> Racing | None:
    """`racing: false` (the default), `true` or `{stop_equivalent: true}`; it races at the branch points."""
    if raw is None or raw is False:
        return None
    if raw is True:
        raw = {}
    if not isinstance(raw, dict):
        raise StudyError(where, f"{raw!r} is not a racing setting",
                         "write racing: false (the default), racing: true or racing: {stop_equivalent: true}")
    refuse_unknown(raw, ("stop_equivalent",), where, "a racing key", "use only stop_equivalent")
    stop = raw.get("stop_equivalent", False)
    if not isinstance(stop, bool):
        raise StudyError(f"{where}.stop_equivalent", f"{stop!r} is not true or false", "write true or false")
    if branches is None:
        raise StudyError(where, "races arms at branch points, and the experiment declares none",
                         "add branches: {at: [0.25, 0.5, 1.0], decay: 0.2} (with train: {lr_schedule: wsd})")
    return Racing(stop)


RHO = 3.0
"""Shape of the alpha spending (alpha * t ** rho): linear spending cost 8-11 points of power against the fixed design
in the racing benchmark, rho = 3 costs 2-4 and still stops an arm worse by twice the margin early."""

RUNG_CORRELATION = 0.7
"""Correlation of one seed's noise between two rungs of a run (one trunk), as :func:`expected_saving` assumes."""

VERDICT_CODES = VERDICTS
"""Verdict of code i in :func:`race_arrays`; -1 is an arm no longer racing."""

NOT_RACING = -1


@dataclass(frozen=True)
class Rung:
    """One branch point of the race, and the alpha it spends."""

    index: int
    """Position among the planned rungs, 0 first."""
    at: float
    """Branch length as a fraction of the run's planned tokens (``branches.at``)."""
    information: float
    """at / the largest rung's at: the information fraction the spending is a power of."""
    alpha: float
    """Alpha this rung's verdicts are reached at."""
    alpha_spent: float
    """Alpha spent by this rung and every earlier one."""

    @property
    def last(self) -> bool:
        """The largest planned rung: nothing is left to train after it."""
        return self.information == 1.0


def rungs(at: Sequence[float], alpha: float, rho: float = RHO) -> tuple[Rung, ...]:
    """Every planned rung with its alpha, alpha * (t_r ** rho - t_{r-1} ** rho) for t_r = at_r / max(at): they sum to
    ``alpha``, so a union bound over the rungs keeps the family-wise error at or below it."""
    points = sorted(float(a) for a in at)
    if not points or points[0] <= 0 or len(set(points)) != len(points):
        raise StudyError("branches.at", f"{list(at)!r} are not distinct positive branch points",
                         "list each point once, e.g. at: [0.25, 0.5, 1.0]")
    if not rho > 0:
        raise StudyError("rho", f"is {rho!r}", "use a positive spending exponent (1: linear in tokens)")
    information = [a / points[-1] for a in points]
    spent = [alpha * t ** rho for t in information]
    return tuple(Rung(i, a, information[i], spent[i] - (spent[i - 1] if i else 0.0), spent[i])
                 for i, a in enumerate(points))


def rung_of(at: float, planned: Sequence[float], alpha: float, rho: float = RHO) -> Rung:
    """The planned rung at branch point ``at``."""
    for rung in rungs(planned, alpha, rho):
        if math.isclose(rung.at, float(at), rel_tol=1e-9, abs_tol=1e-12):
            return rung
    raise StudyError("at", f"{at!r} is not one of the planned branch points {sorted(planned)}",
                     "decide a rung the experiment's branches block declares")


@dataclass(frozen=True)
class RunCost:
    """GPU-hours of one run (variant, scale, seed) of a branched experiment, by part."""

    trunk: tuple[float, ...]
    """The trunk's hours from one branch start to the next: entry i ends at rung i's branch start."""
    branches: tuple[float, ...]
    """Each rung's branch (its decay tail), in rung order."""

    @property
    def total(self) -> float:
        """Every part: the run trained to its end."""
        return sum(self.trunk) + sum(self.branches)


def branched_cost(at: Sequence[float], decay: float) -> RunCost:
    """A run's parts in units of its planned length: a branch of length a starts at a * (1 - decay) and trains
    a * decay; the trunk stops at the last start."""
    points = sorted(float(a) for a in at)
    starts = [a * (1 - decay) for a in points]
    return RunCost(tuple(s - before for s, before in zip(starts, [0.0, *starts[:-1]])),
                   tuple(a * decay for a in points))


def separate_cost(at: Sequence[float]) -> float:
    """Separate straight runs of every branch length, in units of the planned length."""
    return float(sum(at))


def saved_by_stop(cost: RunCost, rung: int) -> float:
    """What a run stopped at ``rung`` does not train: every later branch, and the trunk after that rung's start less
    what it trained while that branch decayed."""
    trunk_left = sum(cost.trunk[rung + 1:])
    return max(0.0, trunk_left - cost.branches[rung]) + sum(cost.branches[rung + 1:])


@dataclass(frozen=True)
class RaceArrays:
    """Many races at once: :func:`race_arrays`'s answer."""

    verdicts: np.ndarray
    """[sims, arms, rungs] verdict codes (index into VERDICT_CODES; -1: not racing at that rung)."""
    stop_rung: np.ndarray
    """[sims, arms] rung each arm stopped at; the number of rungs where it never stopped."""


def race_arrays(deltas: np.ndarray, alphas: Sequence[float], margin: float | None,
                stop_equivalent: bool = False) -> RaceArrays:
    """The race of :func:`analysis.racing.race` on arrays, for simulation: ``deltas`` [sims, arms, rungs, seeds] of a
    lower-is-better metric (variant - baseline), ``alphas`` each rung's. Each rung decides as
    :func:`analysis.decide.decide` does (tests/test_racing.py runs both races on the same deltas)."""
    sims, arms, n_rungs, _ = deltas.shape
    racing = np.ones((sims, arms), bool)
    verdicts = np.full((sims, arms, n_rungs), NOT_RACING, np.int8)
    stop_rung = np.full((sims, arms), n_rungs, np.int64)
    code = {v: i for i, v in enumerate(VERDICT_CODES)}
    for r in range(n_rungs):
        test = paired_t(deltas[:, :, r, :])
        verdict = np.full((sims, arms), code["undecided"], np.int8)
        if margin is not None:
            verdict[holm(test.tost(margin), racing) < alphas[r]] = code["equivalent"]
        rejected = holm(test.p, racing) < alphas[r]
        verdict[rejected] = np.where(test.mean[rejected] > 0, code["worse"], code["better"])
        verdict[~racing] = NOT_RACING
        verdicts[:, :, r] = verdict
        if r < n_rungs - 1:
            stop = (verdict == code["worse"]) | (stop_equivalent & (verdict == code["equivalent"]))
            stop_rung[stop] = r
            racing &= ~stop
    return RaceArrays(verdicts, stop_rung)


def correlated_deltas(rng: np.random.Generator, sims: int, arms: int, seeds: int, effects: np.ndarray,
                      sd: float, rung_correlation: float = RUNG_CORRELATION) -> np.ndarray:
    """[sims, arms, rungs, seeds] paired deltas: ``effects`` [arms, rungs] plus each run's noise (sd sd / sqrt(2),
    ``rung_correlation`` between its rungs), so a delta has sd ``sd`` and two arms' correlate 0.5 at a seed."""
    n_rungs = effects.shape[1]
    run_sd = sd / math.sqrt(2)
    shared = rng.standard_normal((sims, arms + 1, 1, seeds))
    own = rng.standard_normal((sims, arms + 1, n_rungs, seeds))
    noise = run_sd * (math.sqrt(rung_correlation) * shared + math.sqrt(1 - rung_correlation) * own)
    return effects[None, :, :, None] + noise[:, 1:] - noise[:, :1]


def effect_profile(effect: float, information: Sequence[float], growth: float = 0.0) -> np.ndarray:
    """An arm's delta at each rung when it is ``effect`` at the last: effect * t ** growth (0: the same at every
    rung; 1: proportional to tokens; inf: only at the last rung)."""
    t = np.asarray(information, float)
    return effect * (np.where(t < 1.0, 0.0, 1.0) if math.isinf(growth) else t ** growth)


def expected_saving(at: Sequence[float], decay: float, arms: int, seeds: int, sd: float, alpha: float = 0.05,
                    margin: float | None = None, effect: float | Sequence[float] | None = None, growth: float = 0.0,
                    stop_equivalent: bool = False, rho: float = RHO, sims: int = 2000) -> float:
    """Expected share of a branched experiment's GPU-hours that racing does not train, by a small simulation.

    One scale's race of ``arms`` variants besides the baseline, ``seeds`` pairs at every rung, deltas with sd ``sd``
    (:func:`correlated_deltas`) and a true delta of ``effect`` at the last rung (per arm, or one for all; None: no arm
    differs; positive: worse), ``effect * t ** growth`` before. Deterministic; about 10 ms at 2,000 draws.
    """
    points = rungs(at, alpha, rho)
    info = [r.information for r in points]
    per_arm = np.zeros(arms) if effect is None else np.broadcast_to(np.asarray(effect, float), (arms,))
    effects = np.stack([effect_profile(e, info, growth) for e in per_arm])
    deltas = correlated_deltas(np.random.default_rng(0), sims, arms, seeds, effects, sd)
    raced = race_arrays(deltas, [r.alpha for r in points], margin, stop_equivalent)
    cost = branched_cost(at, decay)
    saved = np.array([saved_by_stop(cost, r) for r in range(len(points))] + [0.0])
    return float(saved[raced.stop_rung].sum(axis=1).mean() / ((arms + 1) * cost.total))
