"""Racing at decay-branch points: error rates, power and GPU-hours by simulation with planted effects.

Three designs on the same simulated losses, one scale, a baseline and ARMS variants, seeds paired:

- fixed: separate straight runs of every branch length, decided once at the end (alpha, Holm over the arms);
- branches: one trunk + a decay branch per point (study.plan.racing.branched_cost), decided once at the end. A branch
  equals the straight WSD run of its length (tests/test_branches.py), so its verdicts are the fixed design's;
- racing: branches, every rung decided at its spent alpha (study.plan.racing.race_arrays, which tests/test_racing.py
  checks against analysis.decide.decide), an arm decided worse stops (also equivalent, in the stop-equivalent row).

The loss of (arm, seed, rung) is L(D_rung) = E + B (at D_final)^-beta, plus the arm's planted delta at that rung, plus
a seed's shared noise (one data order and init for every arm at a seed; it cancels in the pairs), plus the run's own
noise, correlated RUNG_CORRELATION between the rungs of one run (they share its trunk), with sd such that a paired
delta has sd SD (the hourglass experiment's prior_sd is 0.004 nats, its margin MARGIN). Effects are in nats at the
final budget (+: worse), equal at every rung (steady) or present only at the last rung (late: racing's adversarial
case). FWER: share of simulations with any better/worse verdict on a truly null arm (at any rung, for racing);
power: share where the arm that differs is decided in its true direction (at the end, or at any rung for racing);
GPU-hours: mean over simulations of every run's parts trained, relative to the fixed design; standard errors are
Monte Carlo's.

    python -m benchmarks --only racing        # one JSON line per figure
"""

from __future__ import annotations

import math
import time

import numpy as np

from study.plan.racing import (RHO, RUNG_CORRELATION, VERDICT_CODES, branched_cost, effect_profile, expected_saving,
                               race_arrays, rungs, saved_by_stop, separate_cost)
from benchmarks.common import row

AT = (0.25, 0.5, 1.0)
DECAY = 0.2
ARMS = 3
ALPHA = 0.05
MARGIN = 0.005
SD = 0.0045
SEEDS = (3, 5, 8)
SCENARIOS = {  # name -> (final-budget delta of arm 0, growth: 0 steady, inf late)
    "null": (0.0, 0.0),
    "worse by the margin": (MARGIN, 0.0),
    "better by the margin": (-MARGIN, 0.0),
    "worse by 2x the margin": (2 * MARGIN, 0.0),
    "worse by the margin, late": (MARGIN, math.inf),
    "better by the margin, late": (-MARGIN, math.inf),
    "worse by 2x the margin, late": (2 * MARGIN, math.inf),
}
CURVE = (1.8, 0.8, 0.3)
"""E, B, beta of L(D) = E + B D^-beta, D in units of the final budget: the rungs' common loss level."""
COMMON_SD = 0.02
"""Seed-to-seed sd shared by every arm at a seed (data order, init): it cancels in the paired deltas."""

WORSE, BETTER = VERDICT_CODES.index("worse"), VERDICT_CODES.index("better")
EQUIVALENT = VERDICT_CODES.index("equivalent")


def losses(rng: np.random.Generator, sims: int, seeds: int, effects: np.ndarray) -> np.ndarray:
    """[sims, 1 + ARMS, rungs, seeds] final losses of every branch, the baseline first."""
    at = np.asarray(AT)
    e, b, beta = CURVE
    run_sd = SD / math.sqrt(2)
    common = COMMON_SD * rng.standard_normal((sims, 1, len(AT), seeds))
    trunk = rng.standard_normal((sims, 1 + ARMS, 1, seeds))
    own = rng.standard_normal((sims, 1 + ARMS, len(AT), seeds))
    noise = run_sd * (math.sqrt(RUNG_CORRELATION) * trunk + math.sqrt(1 - RUNG_CORRELATION) * own)
    planted = np.concatenate([np.zeros((1, len(AT))), effects])[None, :, :, None]
    return (e + b * at ** -beta)[None, None, :, None] + planted + common + noise


def designs(deltas: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per design: verdicts [sims, arms, rungs decided] and the rung each arm stopped at (len(AT): never)."""
    final = race_arrays(deltas[:, :, -1:, :], [ALPHA], MARGIN)
    never = np.full(final.stop_rung.shape, len(AT))
    out = {"fixed": (final.verdicts, never), "branches": (final.verdicts, never)}
    for name, rho, stop_equivalent in ((f"racing (rho {RHO:g})", RHO, False),
                                       ("racing, linear spending (rho 1)", 1.0, False),
                                       (f"racing, stop equivalent (rho {RHO:g})", RHO, True)):
        alphas = [r.alpha for r in rungs(AT, ALPHA, rho)]
        raced = race_arrays(deltas, alphas, MARGIN, stop_equivalent)
        out[name] = (raced.verdicts, raced.stop_rung)
    return out


def measure(sims: int, seeds: int, effect: float, growth: float, seed: int) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    info = [a / max(AT) for a in AT]
    effects = np.zeros((ARMS, len(AT)))
    effects[0] = effect_profile(effect, info, growth)
    loss = losses(rng, sims, seeds, effects)
    deltas = loss[:, 1:] - loss[:, :1]
    cost = branched_cost(AT, DECAY)
    saved = np.array([saved_by_stop(cost, r) for r in range(len(AT))] + [0.0])
    fixed_units = (1 + ARMS) * separate_cost(AT)
    null = slice(1, None) if effect else slice(None)
    out = {}
    for name, (verdicts, stop_rung) in designs(deltas).items():
        false = np.isin(verdicts[:, null], (WORSE, BETTER)).any(axis=(1, 2))
        units = (1 + ARMS) * cost.total - saved[stop_rung].sum(axis=1)
        if name == "fixed":
            units = np.full(sims, fixed_units)
        rel = units / fixed_units
        figures = {"fwer": _rate(false), "gpu_hours": (float(rel.mean()), float(rel.std(ddof=1) / math.sqrt(sims))),
                   "stopped_arms": float((stop_rung < len(AT)).sum(axis=1).mean())}
        if effect:
            right = WORSE if effect > 0 else BETTER
            figures["power"] = _rate((verdicts[:, 0] == right).any(axis=1))
            figures["equivalent_at_a_rung"] = _rate((verdicts[:, 0] == EQUIVALENT).any(axis=1))
            figures["stop_rung_of_the_arm"] = [float(np.mean(stop_rung[:, 0] == r)) for r in range(len(AT) + 1)]
        out[name] = figures
    return out


def _rate(hits: np.ndarray) -> tuple[float, float]:
    p = float(hits.mean())
    return p, math.sqrt(p * (1 - p) / len(hits))


def run(quick: bool) -> list[dict]:
    sims = 2000 if quick else 20000
    cost = branched_cost(AT, DECAY)
    ladder = [0.5, 1.0, 2.0, 4.0, 8.0]
    ladder_cost = branched_cost([a / 8 for a in ladder], DECAY).total * 8
    rows = [row("cost arithmetic: 5 budgets 0.5-8 x Chinchilla, trunk + 20 % branches vs separate runs "
                "(units of 1 x Chinchilla)", ladder_cost, separate_cost(ladder), "units", "lower",
                issue_says=[9.5, 15.5]),
            row(f"cost per run at rungs {list(AT)}, decay {DECAY:g}: trunk + branches vs separate runs "
                "(units of the final budget)", cost.total, separate_cost(AT), "units", "lower"),
            _planner_estimate()]
    setting = {"arms": ARMS, "at": list(AT), "decay": DECAY, "alpha": ALPHA, "margin": MARGIN, "sd_delta": SD,
               "rung_correlation": RUNG_CORRELATION, "rho": RHO, "sims": sims}
    racing = f"racing (rho {RHO:g})"
    for seeds in SEEDS:
        for i, (scenario, (effect, growth)) in enumerate(SCENARIOS.items()):
            start = time.perf_counter()
            figures = measure(sims, seeds, effect, growth, seed=1000 * seeds + i)
            common = {**setting, "seeds": seeds, "scenario": scenario,
                      "seconds": round(time.perf_counter() - start, 2)}
            what = f"{scenario}, {seeds} seeds"
            for key, better, units in (("fwer", "lower", "share"), ("power", "higher", "share"),
                                       ("gpu_hours", "lower", "x fixed")):
                if key in figures["fixed"]:
                    rows.append(row(f"racing {key.replace('_', '-')} vs fixed ({what})", figures[racing][key][0],
                                    figures["fixed"][key][0], units, better,
                                    by_design={d: f[key] for d, f in figures.items()}, **common,
                                    **({"by_design_stop_rung": {d: f["stop_rung_of_the_arm"]
                                                                for d, f in figures.items()},
                                        "by_design_equivalent_at_a_rung": {d: f["equivalent_at_a_rung"]
                                                                           for d, f in figures.items()}}
                                       if key == "power" else {})))
    return rows


def _planner_estimate() -> dict:
    """What `expected_saving` costs the planner per call, and what it says for one arm worse by 2x the margin at 8
    seeds (the same setting as the simulation's row, from its own 2,000 draws)."""
    kwargs = dict(at=AT, decay=DECAY, arms=ARMS, seeds=8, sd=SD, alpha=ALPHA, margin=MARGIN,
                  effect=[2 * MARGIN, 0.0, 0.0])
    expected_saving(**kwargs)
    start = time.perf_counter()
    saving = expected_saving(**kwargs)
    seconds = time.perf_counter() - start
    return row("expected_saving per call (the planner's estimate; seconds)", seconds, 0.05, "s", "lower",
               saving_estimate=saving, setting="one arm of 3 worse by 2x the margin, 8 seeds",
               peer_is="the 50 ms the planner allows")


if __name__ == "__main__":
    import json

    for r in run(quick=False):
        print(json.dumps(r))
