"""Racing at decay-branch points: the alpha each rung spends, which arms stop, on what interval, and what it saves."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.racing import decide_rung, hours_saved, race, stops
from study.plan.racing import (RunCost, branched_cost, expected_saving, race_arrays, rungs, saved_by_stop, separate_cost,
                               t_two_sided_p, VERDICT_CODES)
from conftest import ROOT
from study.config.decision import DecisionRule
from study.errors import StudyError

AT = (0.25, 0.5, 1.0)


@pytest.fixture(autouse=True)
def no_full_collections_in_holm(monkeypatch):
    """statsmodels' Holm calls gc.collect() on every call (~0.1 s in a test process); a collection never changes a
    number."""
    import gc

    monkeypatch.setattr(gc, "collect", lambda *args: 0)


def endpoints(deltas: dict[str, np.ndarray], scale: str = "s", base_loss: float = 3.0) -> pd.DataFrame:
    """Branch endpoints: the baseline at base_loss - 0.1 * at (its own seed noise), each variant that plus its
    [rungs, seeds] deltas."""
    seeds = next(iter(deltas.values())).shape[1]
    base = base_loss - 0.1 * np.asarray(AT)[:, None] + np.random.default_rng(7).normal(0, 0.01, (len(AT), seeds))
    rows = []
    for variant, d in {"base": np.zeros_like(base), **deltas}.items():
        for r, at in enumerate(AT):
            rows += [{"variant": variant, "scale": scale, "seed": s, "at": at, "val/loss": base[r, s] + d[r, s]}
                     for s in range(seeds)]
    return pd.DataFrame(rows)


def t_interval(d: np.ndarray, alpha: float) -> tuple[float, float]:
    half = stats.t.ppf(1 - alpha / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean() - half, d.mean() + half


def test_each_rung_spends_its_share_of_alpha_and_all_rungs_together_spend_alpha():
    linear = rungs([1.0, 0.25, 0.5], 0.05, rho=1)
    assert [r.at for r in linear] == [0.25, 0.5, 1.0]
    assert [r.alpha for r in linear] == pytest.approx([0.0125, 0.0125, 0.025])
    assert [r.alpha_spent for r in linear] == pytest.approx([0.0125, 0.025, 0.05])
    cubic = rungs(AT, 0.05, rho=3)  # alpha * t**3: 1/64, 1/8, 1 of alpha spent by each rung
    assert [r.alpha for r in cubic] == pytest.approx([0.05 / 64, 0.05 * 7 / 64, 0.05 * 56 / 64])
    ladder = rungs([0.5, 1, 2, 4, 8], 0.05, rho=1)
    assert [r.alpha for r in ladder] == pytest.approx([0.05 / 16, 0.05 / 16, 0.05 / 8, 0.05 / 4, 0.05 / 2])
    for spent in (linear, cubic, ladder, rungs([0.1, 0.3, 0.35, 0.9], 0.01)):
        assert sum(r.alpha for r in spent) <= 0.05 + 1e-15 and all(r.alpha > 0 for r in spent)
    assert [r.last for r in cubic] == [False, False, True]


def test_a_point_the_experiment_did_not_plan_is_refused():
    frame = endpoints({"v": np.zeros((3, 3))})
    with pytest.raises(StudyError, match="planned branch points"):
        decide_rung(frame, "base", 0.3, AT, DecisionRule(margin=0.005))


def test_an_arm_far_worse_stops_at_the_first_rung_on_the_paired_t_interval_at_that_rungs_alpha():
    rng = np.random.default_rng(0)
    bad = 0.05 + rng.normal(0, 0.004, (3, 5))
    same = rng.normal(0, 0.004, (3, 5))
    rule = DecisionRule(margin=0.005)
    verdicts = {v.variant: v for v in decide_rung(endpoints({"bad": bad, "same": same}), "base", 0.25, AT, rule)}
    assert set(verdicts) == {"bad", "same"}
    first = rungs(AT, rule.alpha)[0]
    v = verdicts["bad"]
    assert (v.verdict, v.stops, v.rung, v.at, v.n) == ("worse", True, 0, 0.25, 5)
    assert v.alpha == pytest.approx(first.alpha) and v.decision.alpha == pytest.approx(first.alpha)
    assert v.mean_delta == pytest.approx(bad[0].mean())
    assert (v.ci_low, v.ci_high) == pytest.approx(t_interval(bad[0], first.alpha), rel=1e-9)
    assert not verdicts["same"].stops
    [stop] = stops(verdicts.values())
    assert (stop.variant, stop.rung, stop.ci_low, stop.ci_high) == ("bad", 0, v.ci_low, v.ci_high)
    assert stop.to_dict()["gpu_hours_saved"] is None and v.to_dict()["decision"]["verdict"] == "worse"


def test_with_no_planted_effect_nothing_stops_at_a_strict_alpha():
    rng = np.random.default_rng(1)
    frame = endpoints({f"v{i}": rng.normal(0, 0.004, (3, 5)) for i in range(4)})
    verdicts = race(frame, "base", AT, DecisionRule(margin=0.005, alpha=0.001))
    assert len(verdicts) == 4 * 3  # every arm decided at every rung: nobody stopped
    assert not stops(verdicts) and {v.verdict for v in verdicts} <= {"undecided", "equivalent"}


def test_an_arm_decided_equivalent_stops_only_with_stop_equivalent():
    tight = np.random.default_rng(2).normal(0, 0.0003, (3, 5))
    frame = endpoints({"same": tight})
    rule = DecisionRule(margin=0.005)
    for stop_equivalent in (False, True):
        [v] = decide_rung(frame, "base", 0.25, AT, rule, stop_equivalent=stop_equivalent)
        assert v.verdict == "equivalent" and v.stops is stop_equivalent
    assert len(race(frame, "base", AT, rule, stop_equivalent=True)) == 1
    assert len(race(frame, "base", AT, rule)) == 3


def test_a_stopped_arm_is_not_decided_again_and_leaves_the_holm_family():
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(3)
    deltas = {"bad": 0.05 + rng.normal(0, 0.004, (3, 5)), "a": rng.normal(0.004, 0.004, (3, 5)),
              "b": rng.normal(0, 0.004, (3, 5))}
    frame = endpoints(deltas)
    rule = DecisionRule(margin=0.005)
    verdicts = race(frame, "base", AT, rule)
    assert [(v.variant, v.rung) for v in verdicts if v.variant == "bad"] == [("bad", 0)]
    second = {v.variant: v for v in verdicts if v.rung == 1}
    assert set(second) == {"a", "b"}
    p = [stats.ttest_1samp(deltas[v][1], 0.0).pvalue for v in ("a", "b")]
    holm = multipletests(p, method="holm")[1]  # over the two still racing, not three
    assert [second[v].decision.p_adjusted for v in ("a", "b")] == pytest.approx(holm, rel=1e-9)
    again = decide_rung(frame, "base", 0.5, AT, rule, stopped={("bad", "s")})
    assert {v.variant for v in again} == {"a", "b"}


def test_the_baseline_is_never_decided_and_never_stops_even_when_every_arm_beats_it():
    rng = np.random.default_rng(4)
    frame = endpoints({v: -0.05 + rng.normal(0, 0.004, (3, 5)) for v in ("x", "y")})
    verdicts = race(frame, "base", AT, DecisionRule(margin=0.005))
    assert {v.variant for v in verdicts} == {"x", "y"} and len(verdicts) == 6
    assert {v.verdict for v in verdicts} == {"better"} and not stops(verdicts)


def test_stopping_is_per_scale_a_scale_where_the_arm_is_not_worse_keeps_training():
    rng = np.random.default_rng(5)
    frame = pd.concat([endpoints({"v": 0.05 + rng.normal(0, 0.004, (3, 5))}, scale="113M"),
                       endpoints({"v": rng.normal(0, 0.004, (3, 5))}, scale="1B")])
    verdicts = race(frame, "base", AT, DecisionRule(margin=0.005))
    assert [(s.variant, s.scale, s.rung) for s in stops(verdicts)] == [("v", "113M", 0)]
    assert [v.rung for v in verdicts if v.scale == "1B"] == [0, 1, 2]


def test_the_hours_a_stop_saves_are_the_later_branches_and_the_trunk_after_the_rungs_tail():
    costs = {("v", "s", 0): RunCost(trunk=(2.0, 2.0, 4.0), branches=(0.5, 1.0, 2.0)),
             ("v", "s", 1): RunCost(trunk=(3.0, 3.0, 6.0), branches=(0.75, 1.5, 3.0)),
             ("w", "s", 0): RunCost(trunk=(2.0, 2.0, 4.0), branches=(0.5, 1.0, 2.0)),
             ("v", "other", 0): RunCost(trunk=(9.0, 9.0, 9.0), branches=(9.0, 9.0, 9.0))}
    # stopped at rung 0: trunk 2 + 4 left, less the 0.5 it trained while branch 0 decayed, plus branches 1 and 2
    seed0, seed1 = (2 + 4 - 0.5) + (1 + 2), (3 + 6 - 0.75) + (1.5 + 3)
    rung0 = rungs(AT, 0.05)[0]
    stop = stops([_verdict("v", "s", rung0)])
    [costed] = hours_saved(stop, costs)
    assert costed.gpu_hours_saved == pytest.approx(seed0 + seed1)
    assert saved_by_stop(costs["w", "s", 0], 1) == pytest.approx((4 - 1) + 2)
    assert saved_by_stop(costs["w", "s", 0], 2) == 0.0
    assert costs["w", "s", 0].total == pytest.approx(11.5)


def _verdict(variant, scale, rung):
    from analysis.racing import RungVerdict

    return RungVerdict(variant, scale, "base", rung.index, rung.at, "worse", 5, 0.01, 0.005, 0.015, rung.alpha,
                       True, decision=None)


def test_trunk_and_branches_cost_9_5_units_against_15_5_for_five_budgets_from_half_to_8x():
    budgets = [0.5, 1, 2, 4, 8]
    cost = branched_cost([b / 8 for b in budgets], 0.2)
    assert cost.total * 8 == pytest.approx(9.5) and separate_cost(budgets) == 15.5
    assert sum(cost.trunk) * 8 == pytest.approx(6.4) and sum(cost.branches) * 8 == pytest.approx(3.1)
    assert branched_cost(AT, 0.2).total == pytest.approx(1.15)


@pytest.mark.parametrize("df", range(1, 13))
def test_the_closed_form_t_p_is_scipys(df):
    t = np.concatenate([np.linspace(-40, 40, 801), [0.0, 1e-9, 1e3]])
    assert t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(np.abs(t), df), abs=1e-14, rel=1e-6)


def test_the_vectorised_race_reaches_decide_rungs_verdicts_and_stops():
    """The simulation's fast race against the real one (decide: scipy t test, statsmodels TOST and Holm)."""
    rng = np.random.default_rng(6)
    sims, arms, seeds = 8, 3, 4
    rule = DecisionRule(margin=0.005, alpha=0.3)  # a loose alpha, so every verdict turns up
    effects = np.array([0.008, 0.0, -0.006])[:, None, None]
    deltas = effects + rng.normal(0, 0.003, (sims, arms, len(AT), seeds))
    alphas = [r.alpha for r in rungs(AT, rule.alpha)]
    fast = {stop_equivalent: race_arrays(deltas, alphas, rule.margin, stop_equivalent)
            for stop_equivalent in (False, True)}
    seen = set()
    for s in range(sims):
        stop_equivalent = s % 2 == 1
        verdicts = race(endpoints({f"v{a}": deltas[s, a] for a in range(arms)}), "base", AT, rule, stop_equivalent)
        slow = np.full((arms, len(AT)), -1)
        for v in verdicts:
            slow[int(v.variant[1:]), v.rung] = VERDICT_CODES.index(v.verdict)
            seen.add(v.verdict)
        assert (fast[stop_equivalent].verdicts[s] == slow).all(), (s, fast[stop_equivalent].verdicts[s], slow)
        stopped = {int(st.variant[1:]): st.rung for st in stops(verdicts)}
        assert fast[stop_equivalent].stop_rung[s].tolist() == [stopped.get(a, len(AT)) for a in range(arms)]
    assert seen == set(VERDICT_CODES)
    assert (fast[True].stop_rung < len(AT)).sum() > (fast[False].stop_rung < len(AT)).sum()


def test_expected_saving_is_nothing_without_an_effect_and_every_stop_at_the_first_rung_for_a_huge_one():
    kwargs = dict(at=AT, decay=0.2, arms=3, seeds=5, sd=0.0045, margin=0.005)
    assert expected_saving(**kwargs) < 0.01
    # every arm stops at rung 0: each saves 0.85 of its 1.15 units, the baseline trains its 1.15
    assert expected_saving(**kwargs, effect=1.0) == pytest.approx(3 * 0.85 / (4 * 1.15))
    one = expected_saving(**kwargs, effect=[0.02, 0.0, 0.0])
    assert 0 < one <= 0.85 / (4 * 1.15) and expected_saving(**kwargs, effect=[0.02, 0.0, 0.0], growth=math.inf) < one


def test_importing_racing_loads_neither_scipy_pandas_mlflow_nor_torch():
    code = ("import sys, study.plan.racing, analysis.racing; "
            "print([m for m in ('scipy', 'pandas', 'mlflow', 'torch', 'statsmodels') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
