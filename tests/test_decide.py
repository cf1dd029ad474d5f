"""The decision table: four verdicts on a store with known truth, every statistic against the library that defines it."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower
from statsmodels.stats.weightstats import ttost_paired

from analysis.decide import decide, signflip_p
from analysis.paired import paired_deltas
from analysis.power import minimum_detectable_effect, seeds_for_difference, seeds_for_equivalence, t_power
from analysis.report import build_report
from analysis.run_table import experiment_id, read_runs
from conftest import new_store
from study.track.query import open_store
from benchmarks.synthetic_store import synthetic_store
from study.config.decision import DecisionRule
from study.errors import StudyError

EXPERIMENT = "truth"
RULE = DecisionRule(metric="val/loss", margin=0.01)
# better: truly 0.05 lower; same: exactly the baseline; worse: 0.05 higher; short: 0.05 lower but only 1 pair.
EFFECTS = {"base": 0.0, "better": -0.05, "same": 0.0, "worse": 0.05, "short": -0.05}


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    root = tmp_path_factory.mktemp("truth")
    uri = new_store(root / "mlflow.db")
    missing = {("short", "50M", k): "MISSING" for k in range(1, 6)}
    synthetic_store(uri, EXPERIMENT, list(EFFECTS), ["50M"], seeds=6, steps=4, eval_tasks=("arc_easy",),
                    effects=EFFECTS, statuses=missing, seed_sd=0.02, run_sd=0.002, rng_seed=3, items_per_task=40)
    result = build_report(EXPERIMENT, tracking_uri=uri, out_dir=root / "reports", n_resamples=99, rule=RULE)
    return uri, result, root / "reports" / EXPERIMENT


@pytest.mark.integration
def test_known_truth_gives_exactly_the_four_verdicts(truth):
    _, result, _ = truth
    primary = {d["variant"]: d for d in result["decisions"] if d["family"] == "primary"}
    assert {v: d["verdict"] for v, d in primary.items()} == {
        "better": "better", "same": "equivalent", "worse": "worse", "short": "undecided"}
    assert primary["short"]["n"] == 1 and primary["short"]["reason"] == "fewer than 2 seed pairs"
    assert {d["metric"] for d in result["decisions"] if d["family"] == "secondary"} == {
        "eval/arc_easy/acc", "eval/arc_easy/acc_norm"}


def test_every_statistic_matches_scipy_and_statsmodels_on_the_stores_values(truth):
    uri, result, _ = truth
    runs = read_runs(EXPERIMENT, uri)
    base = runs[runs["variant"] == "base"].set_index("seed")["val/loss"]
    rows = {d["variant"]: d for d in result["decisions"] if d["family"] == "primary"}
    p_raw = {}
    for variant in ("better", "same", "worse"):
        v = runs[runs["variant"] == variant].set_index("seed")["val/loss"]
        x, y = v.to_numpy(), base.loc[v.index].to_numpy()
        d, row = x - y, rows[variant]
        assert row["n"] == 6 and row["mean_delta"] == pytest.approx(d.mean(), abs=1e-12)
        assert row["pct_delta"] == pytest.approx(100 * d.mean() / y.mean(), rel=1e-9)
        p_raw[variant] = stats.ttest_rel(x, y).pvalue
        assert row["p_t"] == pytest.approx(p_raw[variant], rel=1e-9)
        low, high = stats.t.interval(0.95, 5, loc=d.mean(), scale=stats.sem(d))
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((low, high), rel=1e-9)
        assert row["p_tost"] == pytest.approx(ttost_paired(x, y, -0.01, 0.01)[0], rel=1e-9)
        assert row["p_wilcoxon"] == pytest.approx(stats.wilcoxon(x, y).pvalue, rel=1e-9)
        flips = np.array(np.meshgrid(*[[-1, 1]] * 6)).reshape(6, -1).T
        exact = np.mean(np.abs((flips * d).mean(axis=1)) >= abs(d.mean()) - 1e-15)
        assert row["p_signflip"] == pytest.approx(exact, rel=1e-9)
        assert row["d_z"] == pytest.approx(d.mean() / d.std(ddof=1), rel=1e-9)
        assert row["mde"] == pytest.approx(
            TTestPower().solve_power(nobs=6, alpha=0.05, power=0.8) * d.std(ddof=1), rel=1e-6)
    # Holm over the whole primary family: the three above plus `short`, which has no p and stays out.
    names = list(p_raw)
    holm = multipletests([p_raw[v] for v in names], alpha=0.05, method="holm")[1]
    for variant, p in zip(names, holm):
        assert rows[variant]["p_adjusted"] == pytest.approx(p, rel=1e-9)


def test_secondary_metrics_are_corrected_with_benjamini_hochberg(truth):
    _, result, _ = truth
    secondary = [d for d in result["decisions"] if d["family"] == "secondary" and d["p_t"] is not None]
    bh = multipletests([d["p_t"] for d in secondary], method="fdr_bh")[1]
    assert [d["p_adjusted"] for d in secondary] == pytest.approx(list(bh), rel=1e-9)
    assert all(d["margin"] is None and d["p_tost"] is None for d in secondary)  # no margin declared for them


def test_report_leads_with_the_decision_table_and_the_report_run_carries_verdicts(truth):
    uri, result, out = truth
    md = (out / "report.md").read_text()
    assert md.index("## Decisions on final val/loss") < md.index("## Final val/loss per scale")
    assert "1 better, 1 worse, 1 equivalent, 1 undecided" in md
    assert "omitted (n < 8)" in md and "BCa" not in md  # 6 seeds: no bootstrap shown as evidence
    mlflow = open_store(uri, required=True)
    run = mlflow.get_run(result["report_run_id"])
    tags = run.data.tags
    assert {k: v for k, v in tags.items() if k.startswith("study.verdict.50M")} == {
        "study.verdict.50M.better": "better", "study.verdict.50M.same": "equivalent",
        "study.verdict.50M.worse": "worse", "study.verdict.50M.short": "undecided"}
    found = mlflow.search_runs([experiment_id(mlflow, EXPERIMENT)],
                               filter_string="tags.`study.verdict.50M.better` = 'better'")
    assert [r.info.run_id for r in found] == [result["report_run_id"]]


def test_undecided_rows_say_how_many_seeds_would_decide_them():
    rng = np.random.default_rng(1)
    df = _frame({"base": 0.0, "near": -0.004}, n=4, sd=0.004, rng=rng)
    (row,) = decide({"val/loss": paired_deltas(df, "val/loss", "base", n_resamples=99)}, DecisionRule())
    assert row.verdict == "undecided" and row.margin is None
    expected = math.ceil(TTestPower().solve_power(effect_size=abs(row.mean_delta) / row.sd_delta, alpha=0.05,
                                                  power=0.8))
    assert row.seeds_to_decide == expected


def test_power_helpers_agree_with_statsmodels():
    test = TTestPower()
    for effect, n, alpha in ((0.3, 10, 0.05), (1.2, 4, 0.0125), (2.0, 3, 0.01)):
        assert t_power(effect, n, alpha) == pytest.approx(test.power(effect, n, alpha), rel=1e-9)
        assert t_power(effect, n, alpha, "larger") == pytest.approx(
            test.power(effect, n, alpha, alternative="larger"), rel=1e-9)
    n = seeds_for_difference(0.01, 0.02, 0.05, 0.8)
    assert n == math.ceil(test.solve_power(effect_size=0.5, alpha=0.05, power=0.8))
    assert t_power(0.5, n, 0.05) >= 0.8 > t_power(0.5, n - 1, 0.05)
    m = seeds_for_equivalence(0.0, 0.01, 0.02, 0.05, 0.8)
    assert t_power(0.5, m, 0.05, "larger") >= 0.9 > t_power(0.5, m - 1, 0.05, "larger")
    assert seeds_for_equivalence(0.02, 0.01, 0.02, 0.05, 0.8) is None  # outside the margin: never equivalent
    # statsmodels' own root finder gives up on the huge effects 2-3 pairs need; the same root, found here
    mde = minimum_detectable_effect(3, 1.0, 0.01, 0.8)
    assert t_power(mde, 3, 0.01) == pytest.approx(0.8, abs=1e-9)


@pytest.mark.parametrize("alternative", ["two-sided", "larger"])
def test_power_matches_scipy_stats_noncentral_t_over_a_grid_of_pairs_effects_and_alphas(alternative):
    from scipy import stats

    for n in range(2, 41):
        for effect in (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 8.0, 15.0):
            for alpha in (0.05, 0.0125, 0.01, 0.001):
                df, nc = n - 1, effect * math.sqrt(n)
                if alternative == "larger":
                    want = stats.nct.sf(stats.t.isf(alpha, df), df, nc)
                else:
                    crit = stats.t.isf(alpha / 2, df)
                    want = stats.nct.sf(crit, df, nc) + stats.nct.sf(crit, df, -nc)
                assert t_power(effect, n, alpha, alternative) == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_the_one_paired_t_tost_and_holm_are_scipys_and_statsmodels_along_the_last_axis(monkeypatch):
    """The report's verdicts, a race's rungs and the plan's simulated races all test with study.plan.paired_t, on
    arrays of families at once: each family's p is scipy's ttest_1samp, its TOST p statsmodels' ttost_paired, and
    Holm over the members a family still tests is statsmodels' multipletests over those alone (the rest: inf)."""
    import gc

    from study.plan.paired_t import holm, paired_t

    monkeypatch.setattr(gc, "collect", lambda *args: 0)  # multipletests' Holm collects on every call; no number moves
    rng = np.random.default_rng(0)
    deltas = rng.normal(0.002, 0.004, (30, 4, 5))
    tested = rng.random((30, 4)) < 0.7
    test = paired_t(deltas)
    assert test.p == pytest.approx(stats.ttest_1samp(deltas, 0.0, axis=-1).pvalue, rel=1e-12)
    tost, adjusted = test.tost(0.005), holm(test.p, tested)
    for family, members in enumerate(tested):
        for arm in range(4):
            want = ttost_paired(deltas[family, arm], np.zeros(5), -0.005, 0.005)[0]
            assert tost[family, arm] == pytest.approx(want, rel=1e-12)
        if members.any():
            want = multipletests(test.p[family, members], method="holm")[1]
            assert adjusted[family, members] == pytest.approx(want, rel=1e-12)
        assert np.isinf(adjusted[family, ~members]).all()
    assert {float(p) for p in adjusted[np.isfinite(adjusted)]} >= {1.0}  # capped at 1, as multipletests caps


def test_signflip_p_is_exact_and_cannot_go_below_two_over_two_to_the_n():
    assert signflip_p(np.array([-1.0, -2.0, -1.5, -0.5, -1.2])) == pytest.approx(2 / 32)
    assert signflip_p(np.array([1.0, -1.0])) == pytest.approx(1.0)


@pytest.mark.parametrize("raw, field", [
    ({"margin": -0.1}, "decision.margin"), ({"alpha": 0.7}, "decision.alpha"), ({"power": 1.5}, "decision.power"),
    ({"marginn": 0.1}, "decision.marginn"), ({"margins": {"eval/a/acc": 0}}, "decision.margins"),
    ({"metric": 3}, "decision.metric"),
])
def test_bad_decision_blocks_name_the_field(raw, field):
    with pytest.raises(StudyError) as err:
        DecisionRule.from_mapping(raw)
    assert err.value.field == field


def _frame(effects: dict[str, float], n: int, sd: float, rng, scale: str = "s"):
    import pandas as pd

    rows = [{"run_id": f"{v}{k}", "run_key": f"{v}{k}", "variant": v, "scale": scale, "seed": k,
             "status": "FINISHED", "start_time": 0, "failure_reason": None, "params_counted": 1000,
             "val/loss": 3.0 + e + rng.normal(0, sd)} for v, e in effects.items() for k in range(n)]
    return pd.DataFrame(rows)


def test_plan_shows_the_seeds_each_comparison_needs_from_the_prior_then_from_measured_noise(truth, monkeypatch,
                                                                                            tmp_path, capsys):
    import json

    from analysis.power import measured_noise, plan_power
    from study.cli import main
    from study.plan.planner import plan_experiment

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["plan", "demo", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(p["variant"], p["source"]) for p in shown["power"]] == [("hourglass", "prior"), ("tapered", "prior")]

    plan = plan_experiment("demo")
    rule = DecisionRule(margin=0.02, prior_sd=0.02)
    rows = plan_power(plan, rule)
    assert [(r.scale, r.variant, r.source) for r in rows] == [("tiny", "hourglass", "prior"), ("tiny", "tapered", "prior")]
    # margin / sd = 1 at Bonferroni alpha 0.05 / 2 comparisons
    need = math.ceil(TTestPower().solve_power(effect_size=1.0, alpha=0.025, power=0.8))
    assert rows[0].seeds_difference == need
    one_sided = math.ceil(TTestPower().solve_power(effect_size=1.0, alpha=0.025, power=0.9, alternative="larger"))
    assert rows[0].seeds_equivalence == one_sided and rows[0].seeds_needed == max(need, one_sided)
    assert shown["power"][0]["seeds_needed"] == rows[0].seeds_needed  # the demo file declares this rule
    hours = {(r.config.variant, r.config.scale): r.gpu_hours() for r in plan.runs}
    assert rows[0].gpu_hours == pytest.approx(rows[0].seeds_needed * (hours["hourglass", "tiny"]
                                                                      + hours["conventional", "tiny"]))
    uri, _, _ = truth
    measured, note = measured_noise(EXPERIMENT, "base", RULE, uri)
    runs = read_runs(EXPERIMENT, uri)
    base = runs[runs["variant"] == "base"].set_index("seed")["val/loss"]
    worse = runs[runs["variant"] == "worse"].set_index("seed")["val/loss"]
    assert measured["50M", "worse"] == pytest.approx(((worse - base).std(ddof=1), 6), rel=1e-9)
    assert ("50M", "short") not in measured and "3 finished pairs" in note
    absent, why = measured_noise(EXPERIMENT, "base", RULE, "sqlite:////nonexistent/dir/mlflow.db")
    assert absent == {} and why.startswith("no store at")


def test_a_plan_reads_the_measured_noise_once_per_version_of_the_store(truth, tmp_path, monkeypatch):
    """The second plan of an unchanged SQLite store takes the noise from study's cache without importing MLflow (about
    3 s of a plan that is otherwise under 1); a store written since is read again."""
    import json
    import shutil
    import subprocess
    import sys

    from mlflow import MlflowClient

    from analysis.power import measured_noise

    db = tmp_path / "mlflow.db"
    shutil.copyfile(truth[0].removeprefix("sqlite:///"), db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    first = measured_noise(EXPERIMENT, "base", RULE, uri)
    again = subprocess.run([sys.executable, "-c", f"""
import json, sys
from analysis.power import measured_noise
from study.config.decision import DecisionRule
found, note = measured_noise({EXPERIMENT!r}, "base", DecisionRule(metric="val/loss", margin=0.01), {uri!r})
print(json.dumps([sorted([*k, *v] for k, v in found.items()), note, "mlflow" in sys.modules]))
"""], capture_output=True, text=True, env=os.environ, check=True)
    found, note, imported = json.loads(again.stdout)
    assert found == sorted([*k, *v] for k, v in first[0].items()) and note == first[1] and not imported

    client = MlflowClient(uri)  # a later final loss for one `worse` seed: its paired sd changes
    runs = read_runs(EXPERIMENT, uri)
    moved = runs[(runs["variant"] == "worse") & (runs["seed"] == 0)].iloc[0]
    client.log_metric(moved["run_id"], "val/loss", moved["val/loss"] + 0.3, step=10**6)
    changed, _ = measured_noise(EXPERIMENT, "base", RULE, uri)
    runs = read_runs(EXPERIMENT, uri)
    base = runs[runs["variant"] == "base"].set_index("seed")["val/loss"]
    worse = runs[runs["variant"] == "worse"].set_index("seed")["val/loss"]
    assert changed["50M", "worse"] == pytest.approx(((worse - base).std(ddof=1), 6), rel=1e-9)
    assert changed["50M", "worse"][0] != pytest.approx(first[0]["50M", "worse"][0], rel=1e-3)


def test_task_deltas_carry_a_two_level_interval_over_the_runs_own_items(truth):
    import pandas as pd

    from analysis.items import read_items

    uri, result, out = truth
    runs = read_runs(EXPERIMENT, uri)
    items = read_items(open_store(uri, required=True), runs["run_id"])
    row = next(i for i in result["item_deltas"] if (i["variant"], i["metric"]) == ("worse", "ll_correct"))
    by = {(r.variant, r.seed): items[r.run_id] for r in runs.itertuples()}
    deltas = np.array([by["worse", s]["ll_correct"].to_numpy() - by["base", s]["ll_correct"].to_numpy()
                       for s in range(6)])
    assert (row["n_seeds"], row["n_items"]) == (6, 40) and row["task"] == "arc_easy"
    assert row["mean_delta"] == pytest.approx(deltas.mean(), abs=1e-12)
    assert row["baseline_mean"] == pytest.approx(np.mean([by["base", s]["ll_correct"].mean() for s in range(6)]))
    assert row["ci_low"] < row["mean_delta"] < row["ci_high"]
    assert row["variant_mean"] == pytest.approx(np.mean([by["worse", s]["ll_correct"].mean() for s in range(6)]))
    assert row["chance"] is None  # a log-likelihood has no chance level (NaN, written as JSON null)
    acc = next(i for i in result["item_deltas"] if (i["variant"], i["metric"]) == ("worse", "acc"))
    assert acc["chance"] == 0.25  # the synthetic arc_easy's items have 4 choices each
    assert acc["variant_mean"] == pytest.approx(np.mean([by["worse", s]["acc"].mean() for s in range(6)]))
    report = (out / "report.md").read_text()
    assert "Downstream tasks, item level" in report and "| chance |" in report.replace("  ", " ")
    assert isinstance(items[runs.run_id[0]], pd.DataFrame)


def test_two_level_bootstrap_reduces_to_each_single_level_bootstrap():
    from analysis.items import two_level_bootstrap

    rng = np.random.default_rng(5)
    # no item-to-item spread: only seeds vary, so it is the percentile bootstrap of the seed means
    seeds_only = np.repeat(rng.normal(0.1, 0.05, size=(6, 1)), 30, axis=1)
    low, high = two_level_bootstrap(seeds_only, n_resamples=40000, seed=1)
    ref = stats.bootstrap((seeds_only[:, 0],), np.mean, n_resamples=40000, method="percentile", rng=2)
    assert (low, high) == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high), abs=2e-3)
    # identical seeds: only items vary, so it is the percentile bootstrap of the item means
    items_only = np.repeat(rng.normal(0.0, 1.0, size=(1, 50)), 4, axis=0)
    low, high = two_level_bootstrap(items_only, n_resamples=40000, seed=1)
    ref = stats.bootstrap((items_only[0],), np.mean, n_resamples=40000, method="percentile", rng=2)
    assert (low, high) == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high), abs=0.01)


def test_a_single_pair_takes_the_seeds_it_needs_from_the_prior_sd():
    rng = np.random.default_rng(2)
    df = _frame({"base": 0.0, "one": -0.01}, n=1, sd=0.0, rng=rng)
    rule = DecisionRule(margin=0.02, prior_sd=0.02)
    (row,) = decide({"val/loss": paired_deltas(df, "val/loss", "base", n_resamples=0)}, rule)
    assert row.verdict == "undecided" and row.n == 1
    # |delta| = 0.01 inside the margin 0.02: equivalence (effect 0.5) needs fewer pairs than finding 0.01 (0.5 too,
    # but two-sided at power 0.8 vs one-sided at 0.9): the smaller of the two
    assert row.seeds_to_decide == min(seeds_for_difference(0.01, 0.02, 0.05, 0.8),
                                      seeds_for_equivalence(-0.01, 0.02, 0.02, 0.05, 0.8))
    assert "prior sd 0.02" in row.reason


@pytest.mark.integration
def test_study_report_prints_the_decisions(truth, capsys, tmp_path, monkeypatch):
    import re

    from study.cli import main

    monkeypatch.setenv("COLUMNS", "200")  # one table row per line, whatever terminal the suite runs in
    uri, _, _ = truth
    assert main(["report", EXPERIMENT, "--tracking-uri", uri, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"report: {tmp_path / EXPERIMENT / 'report.md'}" in out, out
    # no experiment file declares a margin for `truth`, so from the command line `same` cannot be equivalent
    for variant, verdict in {"better": "better", "same": "undecided", "worse": "worse", "short": "undecided"}.items():
        assert re.search(rf"\b{variant}\W+val/loss\W.*\b{verdict}\b", out), (variant, out)
    assert not re.search(r"\bsame\W+val/loss\W.*\bequivalent\b", out), out


def test_a_delta_tiny_against_its_spread_needs_no_reachable_number_of_seeds():
    assert seeds_for_difference(1e-12, 0.02, 0.05, 0.8) is None
    assert seeds_for_equivalence(0.0, 1e-12, 0.02, 0.05, 0.8) is None
    assert seeds_for_difference(0.02, 0.02, 0.05, 0.8) == math.ceil(
        TTestPower().solve_power(effect_size=1.0, alpha=0.05, power=0.8))


def test_deltas_equal_up_to_rounding_are_undecided_not_significant():
    """Three seeds whose task accuracies on 48 items differ from the baseline's by one item each: the deltas are
    -1/48 up to the last bit, so their computed sd is rounding noise and a t test would give p ~ 0."""
    import pandas as pd

    base, arm = [0.5, 0.5625, 0.4375], [0.5 - 1 / 48, 0.5625 - 1 / 48, 0.4375 - 1 / 48]
    deltas = np.subtract(arm, base)
    assert np.std(deltas, ddof=1) > 0 and stats.ttest_1samp(deltas, 0.0).pvalue < 1e-6  # what the t test alone says
    df = pd.DataFrame([{"run_id": f"{v}{k}", "run_key": f"{v}{k}", "variant": v, "scale": "s", "seed": k,
                        "status": "FINISHED", "start_time": 0, "failure_reason": None, "params_counted": 1000,
                        "eval/task/acc": acc} for v, accs in (("base", base), ("arm", arm))
                       for k, acc in enumerate(accs)])
    (row,) = decide({"eval/task/acc": paired_deltas(df, "eval/task/acc", "base", n_resamples=0)},
                    DecisionRule(metric="val/loss"))
    assert (row.verdict, row.sd_delta, row.reason) == ("undecided", 0.0,
                                                       "every delta is identical: no spread to test against")
    assert row.mean_delta == pytest.approx(-1 / 48, abs=1e-15)
