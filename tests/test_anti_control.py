"""Study 2's anti control runs against the schedule it controls: on a reference whose raw work rises with depth and
whose normalised work falls (the paper's finding), `geometry` is front-loaded and `anti` its mirror, back-loaded, at
the same budget, as the planner completes the scheduled runs from the profile (what a launch trains)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import spearmanr

from conftest import new_store
from study.config.geometry import AllocationConfig
from study.geometry.allocate import reversed_profile, geometry_widths, read_profile, smooth_profile
from study.plan.budget import target_width
from study.plan.complete import complete_spec
from study.plan.planner import plan_experiment

# one worker builds the module's fixtures (a planned experiment, a synthetic store and its report) once
pytestmark = pytest.mark.xdist_group("anti_control")

SCALE = "128M"
LAYERS = 8  # the 128M reference's depth


def rising_raw_falling_normalised_profile() -> dict:
    """A profile shaped as the paper finds: raw work grows with the residual norm, spherical and hyperbolic work is
    front-loaded; intrinsic dimensions and sensitivities vary over depth as a trained model's do."""
    depth = np.arange(LAYERS)
    curves = {"raw": 1.0 + 0.5 * depth ** 1.3, "spherical": 0.04 + 0.30 * np.exp(-depth / 3.5),
              "hyperbolic": 0.05 + 0.35 * np.exp(-depth / 3.0)}
    stats = {s: {g: c.tolist() for g, c in curves.items()} for s in ("shift", "gw", "topo")}
    return {"layers": LAYERS, "n_tokens": 1024, "stats": stats,
            "intrinsic_dim": [10.0, 14.0, 18.0, 20.0, 22.0, 22.0, 21.0, 19.0],
            "sensitivity": [1.5, 1.1, 1.0, 0.9, 0.8, 0.8, 0.8, 0.9]}


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory) -> dict:
    """variant -> (the pending spec the planner makes before the profile exists, the spec it completes after).

    The shipped geometry experiment without its `tune:` block: tuned, its scheduled runs would also wait for their
    reference's tuning, and this module is about what the profile alone decides."""
    import shutil

    from conftest import ROOT

    runs, tree = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("sweeps") / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    path = tree / "experiment" / "geometry.yaml"
    path.write_text("\n".join(line for line in path.read_text().splitlines() if not line.startswith("tune:")))
    overrides = [f"paths.runs={runs}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STUDY_SWEEPS", str(tree))
        before = plan_experiment("geometry", overrides)
        reference = next(r for r in before.runs if r.role == "reference" and r.config.scale == SCALE)
        reference.run_dir.profile.parent.mkdir(parents=True, exist_ok=True)
        reference.run_dir.profile.write_text(json.dumps(rising_raw_falling_normalised_profile()))
        after = {(r.config.variant, r.config.seed): r for r in plan_experiment("geometry", overrides).runs
                 if r.config.scale == SCALE}
    return {r.config.variant: (r, after[r.config.variant, r.config.seed]) for r in before.runs
            if r.config.scale == SCALE and r.config.seed == 0 and r.role == "scheduled"}


def allocated(spec) -> np.ndarray:
    """The real-valued widths complete_spec allocates for a pending spec, before the matcher rounds them."""
    cfg = spec.config
    return np.array(geometry_widths(read_profile(spec.profile), target_width(cfg.model) * cfg.model.ffn.k,
                                    cfg.model.n_layers, cfg.geometry, reverse=cfg.model.ffn.schedule.reverse))


def test_the_profile_runs_one_way_raw_and_the_other_way_normalised():
    stats = rising_raw_falling_normalised_profile()["stats"]["topo"]
    assert np.all(np.diff(stats["raw"]) > 0)
    assert np.all(np.diff(stats["spherical"]) < 0) and np.all(np.diff(stats["hyperbolic"]) < 0)


def test_anti_follows_the_same_curve_as_geometry_reversed(scheduled):
    geometry, anti = scheduled["geometry"][0].config, scheduled["anti"][0].config
    assert (anti.geometry.statistic, anti.geometry.geometry) == (geometry.geometry.statistic,
                                                                   geometry.geometry.geometry) == ("topo", "hyperbolic")
    assert anti.model.ffn.schedule.reverse and not geometry.model.ffn.schedule.reverse
    assert anti.geometry == geometry.geometry  # every allocation setting shared: only the direction differs


def test_geometry_is_front_loaded_and_anti_back_loaded_as_planned(scheduled):
    geo, anti = (np.array(scheduled[v][1].model.ffn.widths) for v in ("geometry", "anti"))
    depth = np.arange(LAYERS)
    assert geo.argmax() == 0 and spearmanr(geo, depth).statistic < -0.9
    assert anti.argmin() == 0 and spearmanr(anti, depth).statistic > 0.9
    half = LAYERS // 2
    assert geo[:half].sum() > geo[half:].sum() and anti[:half].sum() < anti[half:].sum()


def test_anti_is_the_mirror_of_geometry_in_exactly_the_opposite_order(scheduled):
    geo, anti = allocated(scheduled["geometry"][0]), allocated(scheduled["anti"][0])
    assert spearmanr(geo, anti).statistic == pytest.approx(-1.0, abs=1e-12)
    np.testing.assert_array_equal(np.argsort(anti), np.argsort(geo)[::-1])
    # independently: each layer's width above the bound reflected about its midrange, rescaled to the same total
    cfg = scheduled["anti"][0].config
    u, f = target_width(cfg.model), cfg.geometry.w_min_fraction
    excess = geo / u - f
    mirrored = excess.max() + excess.min() - excess
    np.testing.assert_allclose(anti / u, f + mirrored * excess.sum() / mirrored.sum(), rtol=1e-12)
    assert anti.min() >= f * u * (1 - 1e-12)
    # rounding to the width multiple keeps the direction: the planned widths still mirror each other
    planned = [scheduled[v][1].model.ffn.widths for v in ("geometry", "anti")]
    assert spearmanr(*planned).statistic < -0.95


def test_both_arms_meet_the_same_budget(scheduled):
    geo, anti = scheduled["geometry"][1], scheduled["anti"][1]
    assert geo.budget == anti.budget
    assert all(abs(s.mismatch) <= s.config.budget.tolerance for s in (geo, anti))
    assert sum(geo.model.ffn.widths) == sum(anti.model.ffn.widths)
    assert allocated(scheduled["geometry"][0]).sum() == pytest.approx(allocated(scheduled["anti"][0]).sum(),
                                                                        rel=1e-12)


def test_the_planner_completes_each_run_as_its_job_will(scheduled):
    for pending, planned in scheduled.values():
        assert pending.pending and planned.pending is None
        assert complete_spec(pending) == planned


def test_reflecting_the_raw_work_instead_runs_with_geometry_and_the_anti_no_longer_does(scheduled):
    """The control's former construction, the smoothed raw topological work reflected before allocation, is
    front-loaded on this profile like `geometry`: it controlled nothing. The anti now trains other widths, the other
    way."""
    pending = scheduled["geometry"][0]
    cfg, profile = pending.config, read_profile(pending.profile)
    raw = smooth_profile(profile["stats"]["topo"]["raw"], cfg.geometry.smoothing, cfg.geometry.smoothing_width)
    profile["stats"]["topo"]["raw"] = reversed_profile(raw).tolist()
    former = geometry_widths(profile, target_width(cfg.model), LAYERS,
                             replace(cfg.geometry, geometry="raw", smoothing="none"))
    geo, anti = (scheduled[v][1].model.ffn.widths for v in ("geometry", "anti"))
    assert np.argmax(former) == np.argmax(geo) == 0 and spearmanr(former, geo).statistic > 0.9
    assert anti != geo and np.argmin(anti) == np.argmax(geo)


def test_with_every_layer_on_its_bound_the_anti_is_the_uniform_allocation():
    flat = AllocationConfig(w_min_fraction=1.0)
    profile = rising_raw_falling_normalised_profile()
    assert geometry_widths(profile, 3840.0, LAYERS, flat, reverse=True) == [3840.0] * LAYERS


def linear_profile() -> dict:
    """Raw work rising linearly with depth, spherical and hyperbolic work falling linearly: over 8 layers the excess
    above the minimum centres at 5/7 of depth (raw) and at 2/7 (normalised)."""
    depth = np.arange(LAYERS, dtype=float)
    curves = {"raw": 1.0 + depth, "spherical": 0.05 * (9.0 - depth), "hyperbolic": 0.1 * (8.0 - depth)}
    return {"layers": LAYERS, "n_tokens": 1024,
            "stats": {s: {g: c.tolist() for g, c in curves.items()} for s in ("shift", "gw", "topo")},
            "intrinsic_dim": [16.0] * LAYERS, "sensitivity": [1.0] * LAYERS}


@pytest.fixture(scope="module")
def profile_report(tmp_path_factory) -> tuple[dict, str, str]:
    """(report.json, report.md, report.html) of a synthetic study 2 store: a uniform reference profiled at 128M, the
    `geometry` and `anti` arms scheduled from it with the widths the allocator gives them."""
    from mlflow import MlflowClient

    from analysis.profile_section import reference_profile_section
    from analysis.report import build_report
    from analysis.run_table import read_runs
    from benchmarks.synthetic_store import synthetic_store

    root = tmp_path_factory.mktemp("store")
    uri, experiment = new_store(root / "mlflow.db"), "geometry_profile"
    synthetic_store(uri, experiment, ["uniform", "geometry", "anti"], {SCALE: 128_000_000}, seeds=2, steps=10,
                    eval_tasks=())
    assert reference_profile_section(read_runs(experiment, uri), uri, root).blocks == []  # no reference: no section
    client = MlflowClient(uri)
    runs = {(r.data.tags["study.variant"], int(r.data.tags["study.seed"])): r.info.run_id
            for r in client.search_runs([client.get_experiment_by_name(experiment).experiment_id])}
    profile = linear_profile()
    (root / "geometry").mkdir()
    (root / "geometry" / "profile.json").write_text(json.dumps(profile))
    client.set_tag(runs["uniform", 0], "study.role", "reference")
    client.log_artifact(runs["uniform", 0], str(root / "geometry" / "profile.json"), "geometry")
    for variant, reverse in (("geometry", False), ("anti", True)):
        widths = [round(w) for w in geometry_widths(profile, 3840.0, LAYERS, AllocationConfig(), reverse=reverse)]
        for seed in (0, 1):
            client.set_tag(runs[variant, seed], "study.role", "scheduled")
            for key, value in {"geometry.statistic": "topo", "geometry.geometry": "hyperbolic",
                               "model.ffn.schedule.reverse": json.dumps(reverse),
                               "resolved.ffn_widths": json.dumps(widths)}.items():
                client.log_param(runs[variant, seed], key, value)
    result = build_report(experiment, tracking_uri=uri, out_dir=root / "reports", log_to_mlflow=False,
                          n_resamples=99)
    out = root / "reports" / experiment
    return result, (out / "report.md").read_text(), (out / "report.html").read_text()


@pytest.mark.integration
def test_the_report_names_each_curve_and_each_arm_by_its_direction(profile_report):
    result, md, html = profile_report
    back, front = f"back-loaded (centre at {5 / 7:.0%} of depth)", f"front-loaded (centre at {2 / 7:.0%} of depth)"
    assert "## Reference work profile" in md and "<h2>Reference work profile</h2>" in html
    assert f"| {SCALE} | topo | {back} | {front} | {front} |" in md
    assert f"| {SCALE} | geometry | topo / hyperbolic | {front} | front-loaded" in md
    assert f"| {SCALE} | anti | topo / hyperbolic, reversed | {back} | back-loaded" in md
    arms = {a["variant"]: a for a in result["reference_profile"]}
    assert {v: (a["direction"], a["widths_direction"]) for v, a in arms.items()} == {
        "geometry": ("front-loaded", "front-loaded"), "anti": ("back-loaded", "back-loaded")}
    assert arms["geometry"]["centre"] == pytest.approx(2 / 7) and arms["anti"]["centre"] == pytest.approx(5 / 7)
    assert "![" in md and "reference_profile.png" in md and "data:image/png;base64," in html
