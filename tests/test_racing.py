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
                               VERDICT_CODES)
from conftest import ROOT
from study.config.decision import DecisionRule
from study.errors import StudyError

AT = (0.25, 0.5, 1.0)


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


def test_the_vectorised_race_reaches_decide_rungs_verdicts_and_stops():
    """The race a plan simulates (arrays of many races) stops what the launch's race (decide_rung, a rung at a time
    through analysis.decide) stops: both test with study.plan.paired_t, so what this pins is the rest, the order of
    the verdicts, who stays in the Holm family and who stops."""
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


STOP_LINE = {"variant": "v", "scale": "s", "baseline": "base", "rung": 0, "at": 0.5, "verdict": "worse", "n": 4,
             "mean_delta": 0.5, "ci_low": 0.4, "ci_high": 0.6, "alpha": 0.00625, "stops": True}
"""A stopping verdict's line of racing.jsonl as it was written before the line recorded gpu_hours_saved."""


def test_the_races_record_holds_each_stop_as_the_verdicts_own_line_with_the_hours_it_saved():
    """One record for a verdict and a stop: the record's stop is the line racing.jsonl holds for it, costed from the
    roster (an older line without gpu_hours_saved too), and a verdict reads back from its line unchanged."""
    from analysis.racing import RungVerdict, line_problem, race_record

    def runs(variant):  # a 32-step trunk costing 4 GPU-hours, branch starts at steps 16 and 32, branches 0.5 and 1
        trunk = {"key": f"{variant}-t", "role": "trunk", "variant": variant, "scale": "s", "seed": 0, "trunk": None,
                 "at": None, "starts": [16, 32], "gpu_hours": 4.0}
        return [trunk] + [{"key": f"{variant}-{at}", "role": "branch", "variant": variant, "scale": "s", "seed": 0,
                           "trunk": f"{variant}-t", "at": at, "starts": [round(32 * at * 0.8)], "gpu_hours": hours}
                          for at, hours in ((0.5, 0.5), (1.0, 1.0))]

    roster = {"baseline": "base", "at": [0.5, 1.0], "stop_equivalent": False, "decision": {}, "runs": runs("base") +
              runs("v") + runs("w")}
    going_on = {**STOP_LINE, "variant": "w", "verdict": "undecided", "stops": False, "gpu_hours_saved": None}
    passed = {"at": 1.0, "variant": None, "scale": None, "stops": False, "verdict": "none racing"}
    lines = [STOP_LINE, going_on, passed]
    assert [line_problem(line) for line in lines] == ["", "", ""]
    record = race_record(roster, lines)
    # stopped at the first rung: the trunk's second half (2 h) less the 0.5 h it trained beside that rung's branch,
    # and the branch at 1.0 (1 h)
    assert record["stops"] == [{**STOP_LINE, "gpu_hours_saved": 2.0 - 0.5 + 1.0}]
    assert record["verdicts"] == lines and (record["baseline"], record["at"]) == ("base", [0.5, 1.0])
    assert RungVerdict.from_line(going_on).line() == going_on


def test_a_race_recorded_under_the_artifacts_old_name_is_still_read_and_the_new_name_wins(tmp_path, monkeypatch):
    """The racing run's artifact is race_record.json, named apart from the launch's roster (_launch/racing.json);
    a store written before the rename holds racing.json, which the report still reads."""
    from mlflow import MlflowClient

    from analysis.racing import read_race
    from conftest import new_store
    from study.schema import ROLE_RACING, TAG_ROLE

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(new_store(tmp_path / "mlflow.db"))
    exp = client.create_experiment("raced")
    run = client.create_run(exp, run_name="racing", tags={TAG_ROLE: ROLE_RACING}).info.run_id
    before = {"baseline": "base", "at": [0.5, 1.0], "stop_equivalent": False, "verdicts": [STOP_LINE], "stops": []}
    client.log_dict(run, before, "racing.json")
    assert read_race(client, exp) == before
    now = {**before, "stops": [{**STOP_LINE, "gpu_hours_saved": 2.5}]}
    client.log_dict(run, now, "race_record.json")
    assert read_race(client, exp) == now


def test_importing_racing_loads_neither_scipy_pandas_mlflow_nor_torch():
    code = ("import sys, study.plan.racing, analysis.racing; "
            "print([m for m in ('scipy', 'pandas', 'mlflow', 'torch', 'statsmodels') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
