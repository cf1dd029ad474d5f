"""The ladder end to end at its smallest: the shipped `ladder` experiment reduced to 2 arms x 3 sizes x 2 seeds and a
few dozen steps, trained through the local launcher and reported. Every section the report fills from the branches
(the L(N, D) surface, the effective-compute multiplier, the race, the curves time to target walks) is checked against
what the store holds, read back here from MLflow's own records: nothing is planted."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from benchmarks.ladder_bench import REDUCED as SIZES, reduced_ladder
from conftest import new_store

ARMS = ("conventional", "hourglass")
SEEDS = (0, 1)
POINTS = (0.5, 1.0)


@pytest.fixture(scope="module")
def ladder(tmp_path_factory, data_cache):
    """(store URI, report.json, the working directory), after `study launch ladder cluster=local` and `study report
    ladder`."""
    from analysis.report import build_report
    from study.cli import main

    work = tmp_path_factory.mktemp("ladder")
    uri = new_store(work / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("STUDY_SWEEPS", str(work / "sweeps"))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        reduced_ladder(work / "sweeps")
        assert main(["launch", "ladder", "cluster=local"]) == 0
        report = build_report("ladder", tracking_uri=uri, out_dir=work / "reports", n_resamples=999)
    return uri, report, work


def _store(uri: str) -> tuple[object, list]:
    """The client and every run of the `ladder` experiment, as MLflow holds them."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("ladder").experiment_id
    return client, client.search_runs([exp], max_results=5000)


def _branch_ends(runs: list) -> pd.DataFrame:
    """Every decay branch straight from MLflow's records: its tags, the params that size it and its final val/loss."""
    rows = []
    for r in runs:
        tags, params = r.data.tags, r.data.params
        if tags.get("study.role") != "branch":
            continue
        rows.append({"run_id": r.info.run_id, "variant": tags["study.variant"], "scale": tags["study.scale"],
                     "seed": int(tags["study.seed"]), "at": float(tags["study.branch.at"]),
                     "start": int(tags["study.branch.step"]), "trunk_key": tags["study.trunk_key"],
                     "status": r.info.status, "n": float(params["params.counted"]),
                     "d": float(params["recipe.tokens"]), "flops": float(params["resolved.flops_per_token"]),
                     "steps": int(params["recipe.max_steps"]), "val/loss": r.data.metrics["val/loss"]})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def stored(ladder):
    """(client, every run of the ladder, its branch ends), read from MLflow once for the tests that check against it."""
    client, runs = _store(ladder[0])
    return client, runs, _branch_ends(runs)


@pytest.mark.integration
def test_the_reduced_ladder_trains_every_trunk_and_branch_and_each_branch_names_its_trunk(stored):
    _, runs, ends = stored
    trunks = {r.data.tags["study.run_key"]: r for r in runs if r.data.tags.get("study.role") == "trunk"}
    assert len(trunks) == len(ARMS) * len(SIZES) * len(SEEDS)
    assert len(ends) == len(trunks) * len(POINTS) and set(ends["status"]) == {"FINISHED"}
    for end in ends.itertuples():
        trunk = trunks[end.trunk_key]
        steps = SIZES[end.scale][1]
        # a branch at `at` is the straight run of at x steps, started from its trunk at the end of its stable LR
        assert end.steps == round(end.at * steps) and end.start == end.steps - int(0.25 * end.steps)
        assert end.d == end.steps * 4 * 32
        assert trunk.data.tags["study.variant"] == end.variant and int(trunk.data.tags["study.seed"]) == end.seed


@pytest.mark.integration
def test_the_surface_is_fitted_to_the_branch_ends_mlflow_holds_with_compute_from_their_flops(ladder, stored):
    from analysis.surface import SURFACE, fit_surface

    _, report, _ = ladder
    ends = stored[2]
    surface = report["surface"]
    assert surface["form"] == SURFACE and surface["status"] == "ok"
    assert surface["source"] == "resolved.flops_per_token x recipe.tokens" and surface["fallback"] is None
    for fit in surface["fits"]:
        mine = ends[ends["variant"] == fit["variant"]]
        assert (fit["n_points"], fit["n_sizes"], fit["n_distinct"], fit["seeds"]) == (12, 3, 6, 2)
        assert fit["n_range"] == [mine["n"].min(), mine["n"].max()] and fit["d_range"] == [mine["d"].min(),
                                                                                           mine["d"].max()]
        again = fit_surface(mine.assign(compute=mine["flops"] * mine["d"]), fit["variant"], n_boot=200)
        for name in ("E", "A", "alpha", "B", "beta"):
            assert fit[name] == pytest.approx(getattr(again, name), rel=1e-6), name
        assert fit["interval"] == "range" and fit["boot_fits"] > 0
    # the optima read each arm's planned compute: its runs' own FLOPs per token times the planned run's tokens
    for optimum in surface["optima"]:
        at_scale = ends[(ends["variant"] == optimum["variant"]) & (ends["scale"] == optimum["scale"])]
        assert optimum["compute"] == pytest.approx((at_scale["flops"] * at_scale["d"] / at_scale["at"]).median())
        assert optimum["planned_n"] == at_scale["n"].iloc[0]


@pytest.mark.integration
def test_each_arms_multiplier_and_its_interval_are_read_from_the_stores_branches(ladder, stored):
    from analysis.surface import surface_report

    _, report, _ = ladder
    ends = stored[2]
    frame = ends.assign(params_counted=ends["n"], tokens=ends["d"], flops_per_token=ends["flops"],
                        max_steps=ends["steps"], global_batch=4, seq_len=32, run_name=ends["run_id"])
    again = surface_report(frame, "conventional", n_boot=200)
    multipliers = {m["scale"]: m for m in report["surface"]["multipliers"]}
    assert set(multipliers) == set(SIZES) and {m["variant"] for m in multipliers.values()} == {"hourglass"}
    for m in again.multipliers:
        got = multipliers[m.scale]
        assert got["multiplier"] == pytest.approx(m.multiplier, rel=1e-9) and got["draws"] == m.draws > 0
        assert (got["interval"], got["seeds"]) == ("range", 2)
        assert got["ci_low"] <= got["multiplier"] <= got["ci_high"]
    # the effective compute of the ends at the largest point: every scale's row and the fitted range's
    rows = report["effective_compute"]["rows"]
    assert [r["scale"] for r in rows] == [*SIZES, "lt16–lt32"] and all(r["draws"] > 0 for r in rows)


@pytest.mark.integration
def test_the_race_decided_each_point_on_the_branch_ends_the_store_holds(ladder, stored):
    from scipy import stats

    _, report, work = ladder
    ends = stored[2]
    race = report["racing"]
    assert race["at"] == list(POINTS) and race["baseline"] == "conventional"
    verdicts = {(v["at"], v["scale"]): v for v in race["verdicts"]}
    assert set(verdicts) == {(at, s) for at in POINTS for s in SIZES}
    for (at, scale), v in verdicts.items():
        cell = ends[(ends["at"] == at) & (ends["scale"] == scale)].set_index(["variant", "seed"])["val/loss"]
        deltas = np.array([cell["hourglass", s] - cell["conventional", s] for s in SEEDS])
        # the points' shares of alpha = 0.05: t^3 spending over t = at / 1
        alpha = 0.05 * (at ** 3 - (0.0 if at == POINTS[0] else POINTS[0] ** 3))
        half = stats.t.ppf(1 - alpha / 2, len(SEEDS) - 1) * deltas.std(ddof=1) / math.sqrt(len(SEEDS))
        assert v["alpha"] == pytest.approx(alpha) and v["n"] == len(SEEDS)
        assert v["mean_delta"] == pytest.approx(deltas.mean(), rel=1e-9)
        assert (v["ci_low"], v["ci_high"]) == pytest.approx((deltas.mean() - half, deltas.mean() + half), rel=1e-9)
    # what the launch recorded in the run directory is what the report read from MLflow
    recorded = [json.loads(line) for line in (work / "runs" / "ladder" / "_launch" / "racing.jsonl").read_text()
                .splitlines()]
    assert [(r["at"], r["scale"], r["verdict"]) for r in recorded] == [(v["at"], v["scale"], v["verdict"])
                                                                      for v in race["verdicts"]]
    md = (work / "reports" / "ladder" / "report.md").read_text()
    assert "## Racing" in md and "## L(N, D) per arm" in md and "(isoflop.png)" in md
    # sizes of 8k to 33k parameters: the report says what such a ladder can and cannot answer
    assert report["surface"]["caveat"] in md and "say nothing about the architectures at 113M" in md


@pytest.mark.integration
def test_a_branch_ends_curve_and_hours_to_target_start_from_its_trunks_first_step(ladder, stored):
    """A branch logs only the steps it trains; the straight run it equals starts at step 0 on its trunk. Its curve
    in the report is its trunk's points to the branch's start, then its own, and time to target walks that curve
    at the throughput of both (a branch's own few steps after a restart are no measure of its speed)."""
    from analysis.run_table import read_curves, read_study, trunk_links

    uri, report, _ = ladder
    client, runs, ends = stored
    trunk_ids = {r.data.tags["study.run_key"]: r.info.run_id for r in runs if r.data.tags.get("study.role") == "trunk"}
    ends = ends[ends["at"] == max(POINTS)].set_index(["scale", "variant", "seed"])

    def history(run_id: str, metric: str, until: float = math.inf) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, metric) if m.step <= until)

    def stitched(end, metric: str) -> list[tuple[int, float]]:
        return history(trunk_ids[end.trunk_key], metric, end.start) + history(end.run_id, metric)

    decided = read_study("ladder", uri).runs
    curves = read_curves(decided["run_id"], "val/loss", uri, trunks=trunk_links(decided))
    for end in ends.reset_index().itertuples():
        curve = curves[curves["run_id"] == end.run_id]
        assert list(zip(curve["step"], curve["value"])) == stitched(end, "val/loss")
        assert curve["step"].iloc[0] < end.start  # the trunk's first validation, before the branch's own steps

    def hours(end, target: float) -> tuple[float, float]:
        curve = stitched(end, "val/loss")
        rate = float(np.median([v for _, v in stitched(end, "train/tokens_per_s")]))
        per_hour = 4 * 32 / rate / 3600
        for (s0, v0), (s1, v1) in zip([(None, None), *curve], curve):
            if v1 <= target:
                return (s1 if s0 is None else s0 + (v0 - target) / (v0 - v1) * (s1 - s0)) * per_hour, math.nan
        return math.inf, curve[-1][0] * per_hour

    for row in report["time_to_target"]["rows"]:
        base_h, mine_h = [], []
        for seed in SEEDS:
            base, mine = ends.loc[row["scale"], "conventional", seed], ends.loc[row["scale"], "hourglass", seed]
            base_h.append(hours(base, base["val/loss"])[0])
            reached, total = hours(mine, base["val/loss"])
            mine_h.append(reached if math.isfinite(reached) else total)
        assert row["baseline_hours"] == pytest.approx(np.mean(base_h), rel=1e-9)
        assert row["variant_hours"] == pytest.approx(np.mean(mine_h), rel=1e-9)


@pytest.mark.integration
def test_each_cells_parent_run_summarises_its_planned_runs_ends_and_no_trunk_gains_a_summary(stored):
    """MLflow's runs table folds a cell's runs under its parent, whose val/loss column compares variants at a
    glance: in a branched study that is the mean of the branch ends at the largest point, over the seeds. A trunk
    (a branch's own parent) carries its training curve only."""
    client, runs, ends = stored
    parents = {r.info.run_name: r for r in runs if r.data.tags.get("study.role") == "group"}
    assert set(parents) == {f"{v}-{s}" for v in ARMS for s in SIZES}
    for (variant, scale), cell in ends[ends["at"] == max(POINTS)].groupby(["variant", "scale"]):
        summary = parents[f"{variant}-{scale}"].data.metrics
        assert summary["val/loss"] == pytest.approx(cell["val/loss"].mean(), rel=1e-12)
        assert summary["val/loss/n"] == len(SEEDS)
    for trunk in (r for r in runs if r.data.tags.get("study.role") == "trunk"):
        assert not {"val/loss/n", "val/loss/sd"} & set(trunk.data.metrics)
        starts = set(ends.loc[ends["trunk_key"] == trunk.data.tags["study.run_key"], "start"])
        steps = [m.step for m in client.get_metric_history(trunk.info.run_id, "val/loss")]
        # its validations (every 8 steps and at each branch start), nothing else
        assert steps and set(steps) <= {s for s in range(8, max(starts) + 1, 8)} | starts


def test_the_shipped_ladder_plans_three_arms_at_four_sizes_with_tokens_growing_tuning_branches_and_racing(workdir):
    from study.config.run import Role
    from study.plan.planner import plan_experiment

    plan = plan_experiment("ladder", ["cluster=local"])
    exp = plan.experiment
    assert exp.branches.at == (0.25, 0.5, 1.0) and exp.racing is not None and exp.baseline == "conventional"
    assert exp.tuning.scales == ("cpu250k",) and len(exp.tuning.lr) >= 3
    trunks = [r for r in plan.runs if r.role == Role.trunk]
    assert {r.config.variant for r in trunks} == {"conventional", "hourglass", "tapered"}
    assert {r.config.seed for r in trunks} == {0, 1, 2}
    sizes = {}
    for r in trunks:
        sizes.setdefault(r.config.scale, set()).add((r.params["counted"], r.planned.max_steps))
    assert list(sizes) == ["cpu250k", "cpu600k", "cpu1M", "cpu2M"]
    budgets = [max(n for n, _ in s) for s in sizes.values()]
    assert 2e5 < budgets[0] and budgets[-1] < 3e6 and budgets == sorted(budgets)
    steps = [max(t for _, t in s) for s in sizes.values()]
    assert steps == sorted(steps) and len(set(steps)) == 4  # every size trains on more tokens than the one below
    tune = [r for r in plan.runs if r.role == Role.tune]
    assert {r.config.scale for r in tune} == {"cpu250k"} and len(tune) == 3 * len(exp.tuning.lr)


def test_study_demo_ladder_launches_and_reports_the_ladder_on_this_machine(workdir, monkeypatch):
    """`study demo --ladder` is the longer demo: the `ladder` experiment through the same steps as `study demo`."""
    import study.launch.submit as submit
    import analysis.report as report
    import analysis.headline as headline
    from study.cli import main

    calls = []
    monkeypatch.setattr(submit, "launch", lambda name, overrides, **kw: calls.append(("launch", name, overrides)))
    monkeypatch.setattr(report, "build_report", lambda name, **kw: calls.append(("report", name, str(kw["out_dir"]))))
    monkeypatch.setattr(headline, "print_headline", lambda result: None)
    assert main(["demo", "--ladder"]) == 0
    assert calls == [("launch", "ladder", ["cluster=local"]), ("report", "ladder", "reports")]


def test_a_race_that_saved_a_cpu_ladders_thousandths_of_a_gpu_hour_says_how_many():
    """The plan prices a CPU ladder's runs at an assumed GPU's speed: a stop saves thousandths of a GPU-hour, which
    the racing section states rather than rounding to 0.0."""
    from analysis.document import race_blocks
    from analysis.render import to_markdown

    stop = {"variant": "hourglass", "scale": "cpu250k", "at": 0.25, "verdict": "worse", "n": 3, "mean_delta": 0.31,
            "ci_low": 0.2, "ci_high": 0.42, "alpha": 0.00078, "gpu_hours_saved": 0.000417}
    md = to_markdown(race_blocks({"at": [0.25, 0.5, 1.0], "baseline": "conventional", "stops": [stop],
                                  "verdicts": [{**stop, "stops": True}]}, "val/loss"))
    assert "1 arm(s) stopped, saving about 0.000417 GPU-hours." in md
    assert "| hourglass | cpu250k | 0.25 | worse | 3 | +0.31 | [+0.2, +0.42] | 0.00078 | 0.000417 |" in md
