"""Verdicts in compute and in time: effective compute multipliers read off loss-against-compute fits, and the GPU-hours
each arm needed to reach the baseline's final loss, on synthetic stores with planted truths."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from scipy.optimize import brentq

from analysis.compute import FLOPS_TIMES_TOKENS, SIX_N_D, effective_compute, training_compute
from analysis.report import build_report
from analysis.run_table import read_runs
from analysis.scaling import fit_variant
from benchmarks.synthetic_store import synthetic_store
from analysis.time_to_target import first_reach, time_to_target
from conftest import new_store
from study.config.decision import DecisionRule

pytestmark = pytest.mark.xdist_group("effective_compute")

SCALES = ["20M", "40M", "80M", "160M", "320M"]
# `planted` needs 1.5x its own compute of the baseline's; `matched` is worth exactly its compute. Both spend 1.2x the
# baseline's FLOPs per token, as hourglass_attn does at 113M.
MULTIPLIERS = {"planted": 1.5, "matched": 1.0}
FLOPS = {"planted": 1.2, "matched": 1.2}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    uri = new_store(root / "mlflow.db")
    synthetic_store(uri, "compute", ["base", "planted", "matched"], SCALES, seeds=5, steps=10, eval_tasks=(),
                    effects={}, compute_multipliers=MULTIPLIERS, flops_factors=FLOPS, rng_seed=4)
    result = build_report("compute", tracking_uri=uri, out_dir=root / "reports", n_resamples=999,
                          log_to_mlflow=False)
    return uri, result, root / "reports" / "compute"


@pytest.mark.integration
def test_a_variant_planted_at_1_5x_compute_is_recovered_inside_its_interval_and_1x_holds_1(planted):
    _, result, _ = planted
    block = result["effective_compute"]
    assert block["source"] == FLOPS_TIMES_TOKENS and block["fallback"] is None and block["status"] == "ok"
    headline = {r["variant"]: r for r in block["rows"] if r["fitted_range"]}
    assert set(headline) == {"planted", "matched"} and headline["planted"]["scale"] == "20M–320M"
    for variant, truth in MULTIPLIERS.items():
        row = headline[variant]
        assert row["ci_low"] <= truth <= row["ci_high"], row
        assert row["multiplier"] == pytest.approx(truth, abs=0.05) and row["draws"] == 200
    per_scale = [r for r in block["rows"] if r["variant"] == "planted" and not r["fitted_range"]]
    assert [r["scale"] for r in per_scale] == SCALES


def test_the_multiplier_is_the_baselines_compute_to_reach_the_variants_fitted_loss(planted):
    uri, result, _ = planted
    runs = read_runs("compute", uri)
    client = MlflowClient(uri)
    # compute from the raw params of every run, not through the report's reader
    flops = {r.info.run_id: float(r.data.params["resolved.flops_per_token"]) * float(r.data.params["recipe.tokens"])
             for r in client.search_runs([client.get_experiment_by_name("compute").experiment_id])}
    compute, source, _ = training_compute(runs)
    assert source == FLOPS_TIMES_TOKENS and np.allclose(compute, runs["run_id"].map(flops), rtol=1e-12)
    frame = runs.assign(compute=compute)
    base = fit_variant(frame[frame["variant"] == "base"], "base", "val/loss", n_boot=0, size="compute")
    mine = fit_variant(frame[frame["variant"] == "planted"], "planted", "val/loss", n_boot=0, size="compute")
    row = next(r for r in result["effective_compute"]["rows"] if (r["variant"], r["scale"]) == ("planted", "80M"))
    c = frame.loc[(frame["variant"] == "planted") & (frame["scale"] == "80M"), "compute"].median()
    assert row["compute"] == pytest.approx(c, rel=1e-12)
    # the baseline's compute at that loss, found by root search on its fitted curve instead of the closed form (the
    # report's fits start from the parameter fits, these from the grid: the same optima to about 1e-7)
    needed = brentq(lambda x: float(base.predict(x)) - float(mine.predict(c)), c / 100, c * 100, rtol=1e-12)
    assert row["multiplier"] == pytest.approx(needed / c, rel=1e-6)


@pytest.mark.integration
def test_starting_the_compute_fits_from_the_parameter_fits_changes_no_multiplier(planted):
    from analysis.scaling import scaling_report

    uri, _, _ = planted
    runs = read_runs("compute", uri)
    by_params = scaling_report(runs, "base", n_boot=60, seed=1).fits
    warm = effective_compute(runs, "base", n_boot=60, seed=1, by_params=by_params)
    grid = effective_compute(runs, "base", n_boot=60, seed=1)
    assert [(r.variant, r.scale) for r in warm.rows] == [(r.variant, r.scale) for r in grid.rows]
    for w, g in zip(warm.rows, grid.rows):
        assert (w.multiplier, w.ci_low, w.ci_high) == pytest.approx((g.multiplier, g.ci_low, g.ci_high), rel=1e-5)


def test_multipliers_are_printed_beside_the_deltas_in_every_format(planted):
    _, result, out = planted
    row = next(r for r in result["effective_compute"]["rows"] if r["variant"] == "planted" and r["fitted_range"])
    line = (f"planted: {row['multiplier']:.2f}x compute [{row['ci_low']:.2f}, {row['ci_high']:.2f}] "
            "(range, 5 seeds) over 20M–320M")
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert line in md and line in page
    assert ("| variant | seeds | val/loss (mean ± sd) | PPL | Δ vs base | t 95% CI (unadjusted) | verdict | "
            "effective compute (interval) |") in md
    at_80m = next(r for r in result["effective_compute"]["rows"] if (r["variant"], r["scale"]) == ("planted", "80M"))
    assert f"| {at_80m['multiplier']:.2f}x [{at_80m['ci_low']:.2f}, {at_80m['ci_high']:.2f}] (range, 5 seeds) |" in md
    assert json.loads((out / "report.json").read_text())["effective_compute"]["rows"] == \
        result["effective_compute"]["rows"]


def test_five_seeds_show_the_range_of_the_draws_and_eight_their_95_percent_interval_each_holding_k(planted):
    from analysis.compute import multiplier

    uri, result, _ = planted
    runs = read_runs("compute", uri)
    report = effective_compute(runs, "base", n_boot=60, seed=1)
    rows = [r for r in report.rows if r.variant == "planted"]
    pairs = [(v, b) for v, b in zip(report.fits["planted"].draws(), report.fits["base"].draws())
             if v is not None and b is not None]
    for r in rows:
        drawn = [multiplier(v, b, r.compute) for v, b in pairs]
        assert (r.interval, r.seeds, r.draws) == ("range", 5, len(pairs))
        assert (r.ci_low, r.ci_high) == (min([*drawn, r.multiplier]), max([*drawn, r.multiplier]))
    # eight seeds (three more of each arm's, renumbered from the first three) resample enough for a 95 % interval
    extra = runs[runs["seed"] < 3].assign(seed=lambda f: f["seed"] + 5)
    wide = effective_compute(pd.concat([runs, extra]), "base", n_boot=60, seed=1)
    for r in wide.rows:
        assert (r.interval, r.seeds) == ("95%", 8) and r.ci_low <= r.multiplier <= r.ci_high


@pytest.mark.integration
def test_two_seeds_give_three_resamples_and_no_95_percent_interval(tmp_path):
    from analysis.compute import multiplier

    uri = new_store(tmp_path / "mlflow.db")
    synthetic_store(uri, "two", ["base", "planted"], SCALES[:3], seeds=2, steps=10, eval_tasks=(), effects={},
                    compute_multipliers={"planted": 1.5}, flops_factors={"planted": 1.2}, rng_seed=4)
    report = effective_compute(read_runs("two", uri), "base", n_boot=200)
    pairs = [(v, b) for v, b in zip(report.fits["planted"].draws(), report.fits["base"].draws())
             if v is not None and b is not None]
    row = report.headline()["planted"]
    drawn = {multiplier(v, b, row.compute) for v, b in pairs}
    assert len(drawn) == 3 and (row.interval, row.seeds) == ("range", 2)
    assert (row.ci_low, row.ci_high) == (min([*drawn, row.multiplier]), max([*drawn, row.multiplier]))
    build_report("two", tracking_uri=uri, out_dir=tmp_path, n_resamples=99, log_to_mlflow=False)
    md = (tmp_path / "two" / "report.md").read_text()
    assert f"[{row.ci_low:.2f}, {row.ci_high:.2f}] (range, 2 seeds) over {row.scale}" in md
    assert "95% bootstrap CI" not in md


@pytest.mark.integration
def test_without_flops_and_token_params_compute_is_6ND_for_every_run_and_the_report_says_so(tmp_path):
    uri = new_store(tmp_path / "mlflow.db")
    synthetic_store(uri, "legacy", ["base", "planted"], SCALES[:3], seeds=3, steps=10, eval_tasks=(), effects={},
                    compute_multipliers={"planted": 1.5}, flops_factors={"planted": 1.2}, recipe_params=False)
    runs = read_runs("legacy", uri)
    compute, source, why = training_compute(runs)
    params = {r.info.run_id: r.data.params for r in MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("legacy").experiment_id])}
    expected = runs["run_id"].map(lambda rid: 6 * float(params[rid]["params.counted"]) * float(
        params[rid]["train.max_steps"]) * float(params[rid]["train.global_batch"]) * float(params[rid]["data.seq_len"]))
    assert source == SIX_N_D and "lack resolved.flops_per_token or recipe.tokens" in why
    assert np.allclose(compute, expected, rtol=1e-12)
    report = effective_compute(runs, "base", n_boot=20)
    assert report.source == SIX_N_D and report.fits["planted"].form == "A*N^-alpha"
    # 6ND counts the variant's 1.2x FLOPs per token as the baseline's: its compute looks 1.2x cheaper than it is
    assert report.headline()["planted"].multiplier == pytest.approx(1.5 * 1.2, rel=0.05)
    out = build_report("legacy", tracking_uri=uri, out_dir=tmp_path, n_resamples=99, log_to_mlflow=False)
    assert out["effective_compute"]["fallback"] == why
    assert f"Fallback to 6 N D: {why}." in (tmp_path / "legacy" / "report.md").read_text()


def test_fewer_than_three_scales_give_no_multiplier_and_say_why(planted):
    uri, _, _ = planted
    runs = read_runs("compute", uri)
    report = effective_compute(runs[runs["scale"].isin(SCALES[:2])], "base", n_boot=10)
    assert report.rows == [] and report.status == "needs finished runs at 3 scales (2 so far)"


def test_first_reach_interpolates_between_logged_points():
    steps, values = np.array([10.0, 20.0, 30.0]), np.array([5.0, 4.0, 3.0])
    assert first_reach(steps, values, 3.5) == pytest.approx(25.0)
    assert first_reach(steps, values, 6.0) == 10.0 and first_reach(steps, values, 2.9) == math.inf


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    root = tmp_path_factory.mktemp("timed")
    uri = new_store(root / "mlflow.db")
    # `fast` is 0.03 better at the same speed, `slow` 0.03 better at half the speed, `same` is the baseline again
    synthetic_store(uri, "timed", ["base", "fast", "slow", "same"], ["20M", "40M"], seeds=4, steps=40, eval_tasks=(),
                    effects={"base": 0.0, "fast": -0.03, "slow": -0.03, "same": 0.0}, speeds={"slow": 0.5})
    return uri


def _independent_hours(client, run_id: str, target: float, per_device: float | None = None) -> tuple[float, float]:
    """(GPU-hours to `target` or inf, to the last point) from the run's raw MLflow records."""
    run = client.get_run(run_id)
    curve = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "val/loss"))
    rate = per_device or float(np.median([m.value for m in client.get_metric_history(run_id, "train/tokens_per_s")]))
    per_step = float(run.data.params["recipe.tokens"]) / float(run.data.params["recipe.max_steps"])
    step = math.inf
    for (s0, v0), (s1, v1) in zip([(None, None), *curve], curve):
        if v1 <= target:
            step = s1 if s0 is None else s0 + (v0 - target) / (v0 - v1) * (s1 - s0)
            break
    return step * per_step / rate / 3600, curve[-1][0] * per_step / rate / 3600


@pytest.mark.integration
def test_hours_to_the_baselines_final_loss_follow_each_runs_curve_and_own_throughput(timed):
    from analysis.run_table import read_curves

    runs = read_runs("timed", timed)
    report = time_to_target(runs, read_curves(runs["run_id"], "val/loss", timed), "base", DecisionRule(), timed)
    client = MlflowClient(timed)
    rows = {(r.scale, r.variant): r for r in report.rows}
    for (scale, variant), row in rows.items():
        cell = runs[runs["scale"] == scale].set_index(["variant", "seed"])
        base_h, mine_h, logs = [], [], []
        for seed in range(4):
            target = cell.loc[("base", seed), "val/loss"]
            b, _ = _independent_hours(client, cell.loc[("base", seed), "run_id"], target)
            h, total = _independent_hours(client, cell.loc[(variant, seed), "run_id"], target)
            base_h.append(b)
            mine_h.append(h if math.isfinite(h) else total)
            logs.append(math.log(mine_h[-1] / b))
        assert row.n == 4 and row.target == pytest.approx(cell.loc["base", "val/loss"].mean(), rel=1e-12)
        assert row.baseline_hours == pytest.approx(np.mean(base_h), rel=1e-9)
        assert row.variant_hours == pytest.approx(np.mean(mine_h), rel=1e-9)
        assert row.ratio == pytest.approx(math.exp(np.mean(logs)), rel=1e-9)
        assert row.throughput == "own train/tokens_per_s"
    for scale in ("20M", "40M"):
        # the parameter-matched verdict says both are better; at half the speed `slow` takes longer
        assert rows[scale, "fast"].verdict == "better" and rows[scale, "fast"].ratio < 1
        assert rows[scale, "slow"].verdict == "worse" and rows[scale, "slow"].ratio > 1
        same = rows[scale, "same"]
        assert same.reached < same.n and same.verdict == "undecided"  # lower bounds never make it faster
    assert len(report.devices_unknown) == len(runs)  # synthetic runs log no run spec


@pytest.mark.integration
def test_time_to_target_sits_beside_the_parameter_matched_verdict_in_the_report(timed, tmp_path):
    result = build_report("timed", tracking_uri=timed, out_dir=tmp_path, n_resamples=99, log_to_mlflow=False)
    rows = {(r["scale"], r["variant"]): r for r in result["time_to_target"]["rows"]}
    assert rows["20M", "slow"]["verdict"] == "worse"
    primary = {(d["scale"], d["variant"]): d["verdict"] for d in result["decisions"] if d["family"] == "primary"}
    assert primary["20M", "slow"] == "better"
    slow = rows["20M", "slow"]
    line = (f"| 20M | slow | {slow['target']:.4f} | 4 | {slow['baseline_hours']:.3g} | {slow['variant_hours']:.3g} | "
            f"4/4 | {slow['ratio']:.2f}x | [{slow['ci_low']:.2f}, {slow['ci_high']:.2f}] |")
    md = (tmp_path / "timed" / "report.md").read_text()
    assert line in md and "| worse | better | own train/tokens_per_s |" in md
    assert "<h2>Time to target</h2>" in (tmp_path / "timed" / "report.html").read_text()


@pytest.mark.integration
def test_a_calibrated_shape_sets_the_hours_of_its_runs(timed, tmp_path):
    from analysis.run_table import read_curves
    from study.config.spec import write_spec
    from study.plan.planner import plan_experiment
    from study.plan.throughput import CALIBRATION_EXPERIMENT, PER_DEVICE, TAG_CLUSTER, TAG_SHAPE, devices, shape_key

    uri = new_store(tmp_path / "mlflow.db")
    synthetic_store(uri, "calibrated", ["base", "fast"], ["20M"], seeds=2, steps=40, eval_tasks=(),
                    effects={"base": 0.0, "fast": -0.03})
    spec = replace(plan_experiment("demo", []).runs[0], dir=str(tmp_path / "spec"))
    client = MlflowClient(uri)
    runs = read_runs("calibrated", uri)
    for run_id in runs.loc[runs["variant"] == "fast", "run_id"]:
        client.log_artifact(run_id, str(write_spec(spec)))
    calibration = client.create_run(client.create_experiment(CALIBRATION_EXPERIMENT),
                                    tags={TAG_SHAPE: shape_key(spec), TAG_CLUSTER: spec.config.cluster.name})
    client.log_metric(calibration.info.run_id, PER_DEVICE, 12345.0)
    client.set_terminated(calibration.info.run_id, "FINISHED")

    report = time_to_target(runs, read_curves(runs["run_id"], "val/loss", uri), "base", DecisionRule(), uri)
    (row,) = report.rows
    assert row.throughput == f"measured on {spec.config.cluster.name}, own train/tokens_per_s"
    cell = runs.set_index(["variant", "seed"])
    hours = [_independent_hours(client, cell.loc[("fast", k), "run_id"], cell.loc[("base", k), "val/loss"],
                                per_device=12345.0)[0] for k in range(2)]
    assert devices(spec) == 1 and row.variant_hours == pytest.approx(np.mean(hours), rel=1e-9)
    assert sorted(report.devices_unknown) == ["base-20M-s0", "base-20M-s1"]


def test_an_interval_that_misses_its_estimate_is_taken_out_to_it_and_one_not_computed_stays():
    from analysis.paired import enclosing

    assert enclosing(1.1, 1.3, 1.05) == (1.05, 1.3)
    assert enclosing(1.1, 1.3, 1.2) == (1.1, 1.3)
    assert enclosing(1.1, 1.3, math.inf) == (1.1, math.inf)
    low, high = enclosing(math.nan, math.nan, 1.2)
    assert math.isnan(low) and math.isnan(high)
