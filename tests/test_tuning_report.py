"""Tuning in the report: tune runs are shown as LR curves and never paired, tuned main runs are decided on,
and verdicts at the shared LR stand beside them with every flip flagged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from analysis.report import build_report
from analysis.run_table import read_runs, read_study
from benchmarks.synthetic_store import BASE_LR, synthetic_store, synthetic_tune_runs
from conftest import new_store
from study.track.groups import summary
from study.track.query import write_manifest_tags

pytestmark = pytest.mark.xdist_group("tuning_report")

VARIANTS = ["conventional", "hourglass", "tapered"]
SCALES = ["20M", "40M", "80M"]
SEEDS = 4
GRID = [0.25, 0.5, 1.0, 2.0, 4.0]
OPTIMUM = {"conventional": 1.0, "hourglass": 2.0, "tapered": 0.5}
CHOSEN = {"conventional": (1.0, "interior"), "hourglass": (2.0, "extended"), "tapered": (0.5, "edge")}
# At the shared LR hourglass is 0.03 worse; at its own LR 0.03 better: the verdict flips.
SHARED = {"conventional": 0.0, "hourglass": 0.03, "tapered": 0.0}
TUNED = {"conventional": 0.0, "hourglass": -0.03, "tapered": 0.0}


def _store(root: Path, tune: bool, shared: bool = False) -> str:
    uri = new_store(root / "mlflow.db")
    if shared:
        synthetic_store(uri, "tuned", VARIANTS, SCALES, seeds=SEEDS, steps=20, eval_tasks=("arc_easy",),
                        effects=SHARED, run_sd=0.002, rng_seed=1)
    synthetic_store(uri, "tuned", VARIANTS, SCALES, seeds=SEEDS, steps=20, eval_tasks=("arc_easy",), effects=TUNED,
                    run_sd=0.002, tuned=CHOSEN, rng_seed=2)
    if tune:
        synthetic_tune_runs(uri, "tuned", VARIANTS, "20M", GRID, seeds=2, steps=20, optimum=OPTIMUM)
    return uri


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The store with shared-LR, tuned and tune runs, built once (about 7 s of MLflow writes); each test that reads it
    takes its own copy (`_copy`), so none sees another's writes."""
    root = tmp_path_factory.mktemp("built")
    _store(root, tune=True, shared=True)
    return root / "mlflow.db"


def _copy(built: Path, root: Path) -> str:
    import sqlite3

    with sqlite3.connect(built) as source, sqlite3.connect(root / "mlflow.db") as copy:
        source.backup(copy)  # a consistent copy, whatever the write-ahead log still holds
    return f"sqlite:///{root / 'mlflow.db'}"


@pytest.fixture(scope="module")
def full(built, tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    uri = _copy(built, root)
    result = build_report("tuned", tracking_uri=uri, out_dir=root / "reports", n_resamples=99, log_to_mlflow=False)
    return uri, result, root / "reports" / "tuned"


@pytest.mark.integration
def test_tune_runs_never_change_the_paired_verdicts_fits_or_parent_summaries(tmp_path):
    uri = _store(tmp_path, tune=False)
    before = build_report("tuned", tracking_uri=uri, out_dir=tmp_path / "a", n_resamples=99, log_to_mlflow=False)
    runs_before = read_runs("tuned", uri)
    tune_ids = synthetic_tune_runs(uri, "tuned", VARIANTS, "20M", GRID, seeds=2, steps=20, optimum=OPTIMUM)
    after = build_report("tuned", tracking_uri=uri, out_dir=tmp_path / "b", n_resamples=99, log_to_mlflow=False)
    assert len(tune_ids) == len(VARIANTS) * len(GRID) * 2
    assert read_runs("tuned", uri)["run_id"].tolist() == runs_before["run_id"].tolist()
    for key in ("decisions", "results", "scaling", "effective_compute", "time_to_target"):
        assert after[key] == before[key], key
    assert before["tuning"]["curves"] == [] and len(after["tuning"]["curves"]) == len(VARIANTS)

    # a parent run summarises its cell's seed runs: the tune runs nested under it do not count
    client = MlflowClient(uri)
    cell = [r for r in client.search_runs([client.get_experiment_by_name("tuned").experiment_id], max_results=1000)
            if (r.data.tags["study.variant"], r.data.tags["study.scale"]) == ("hourglass", "20M")]
    main = [r for r in cell if r.data.tags["study.role"] != "tune"]
    assert len(cell) == len(main) + len(GRID) * 2
    metrics, n = summary(cell)
    assert (metrics, n) == summary(main) and n == SEEDS
    assert metrics["val/loss"] == pytest.approx(np.mean([r.data.metrics["val/loss"] for r in main]), rel=1e-12)


@pytest.mark.integration
def test_tuning_curves_show_each_variants_grid_and_chosen_lr_in_every_format(full):
    uri, result, out = full
    client = MlflowClient(uri)
    tune = [r for r in client.search_runs([client.get_experiment_by_name("tuned").experiment_id], max_results=1000)
            if r.data.tags["study.role"] == "tune"]
    curves = {c["variant"]: c for c in result["tuning"]["curves"]}
    assert set(curves) == set(VARIANTS)
    for variant, (multiple, status) in CHOSEN.items():
        c = curves[variant]
        mine = [r for r in tune if r.data.tags["study.variant"] == variant]
        means = [np.mean([r.data.metrics["val/loss"] for r in mine if float(r.data.tags["study.tune.multiple"]) == m])
                 for m in GRID]
        assert c["scale"] == "20M" and c["multiples"] == GRID and len(c["points"]) == len(GRID) * 2
        assert c["mean_losses"] == pytest.approx(means, rel=1e-12)
        assert c["best_multiple"] == OPTIMUM[variant] == GRID[int(np.argmin(means))]
        assert (c["chosen_multiple"], c["status"]) == (multiple, status)
        assert c["chosen_lr"] == pytest.approx(multiple * BASE_LR, rel=1e-12)
        assert c["main_lrs"] == pytest.approx({s: multiple * BASE_LR for s in SCALES}, rel=1e-12)
        lrs = {p["multiple"]: p["lr"] for p in c["points"]}
        assert lrs == pytest.approx({m: m * BASE_LR for m in GRID}, rel=1e-12)
    hg = curves["hourglass"]
    row = (f"| hourglass | 20M | {', '.join(f'×{m:g}: {v:.4f}' for m, v in zip(GRID, hg['mean_losses']))} | 10 | "
           f"×2 | ×2 | {2 * BASE_LR:.4g} | extended |")
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert row in md and "## Tuning curves" in md and "<h2>Tuning curves</h2>" in page
    assert "tapered: the best point stayed at an edge of the grid" in md
    assert "does not move with scale" in md and result["tuning"]["transfer"] in md
    assert (out / "tuning.png").exists() and "tuning.png" in md
    assert json.loads((out / "report.json").read_text())["tuning"]["curves"] == result["tuning"]["curves"]


@pytest.mark.integration
def test_a_verdict_that_flips_between_shared_and_tuned_lr_is_flagged_and_the_tuned_runs_decide(full):
    uri, result, out = full
    study = read_study("tuned", uri)
    assert set(study.runs["lr_source"]) == {"tune"} and set(study.shared_lr["lr_source"]) == {"recipe"}
    assert len(study.tune) == len(VARIANTS) * len(GRID) * 2 and result["tuning"]["decided_on"] == "tune"
    # the decisions are the tuned runs' paired deltas, computed here from those runs alone
    runs = study.runs.set_index(["variant", "scale", "seed"])["val/loss"]
    primary = {(d["scale"], d["variant"]): d for d in result["decisions"] if d["family"] == "primary"}
    for scale in SCALES:
        delta = np.mean([runs["hourglass", scale, k] - runs["conventional", scale, k] for k in range(SEEDS)])
        assert primary[scale, "hourglass"]["mean_delta"] == pytest.approx(delta, rel=1e-12)
        assert primary[scale, "hourglass"]["verdict"] == "better"
    pairs = {(p["metric"], p["scale"], p["variant"]): p for p in result["tuning"]["shared_vs_tuned"]}
    shared = study.shared_lr.set_index(["variant", "scale", "seed"])["val/loss"]
    for scale in SCALES:
        p = pairs["val/loss", scale, "hourglass"]
        assert (p["shared_verdict"], p["tuned_verdict"], p["flip"]) == ("worse", "better", True)
        delta = np.mean([shared["hourglass", scale, k] - shared["conventional", scale, k] for k in range(SEEDS)])
        assert p["shared_delta"] == pytest.approx(delta, rel=1e-12)
    assert result["tuning"]["flips"] == sum(p["flip"] for p in pairs.values()) >= len(SCALES)
    md = (out / "report.md").read_text()
    assert md.count("FLIP: worse → better") >= len(SCALES) and "Decided on the tuned runs" in md
    assert f"the {len(study.shared_lr)} runs at the shared LR are decided beside them" in md


@pytest.mark.integration
def test_each_lr_source_is_the_last_launchs_runs_when_it_trained_any_and_a_missing_tag_means_shared(built, tmp_path):
    uri = _copy(built, tmp_path)
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("tuned").experiment_id
    everything = client.search_runs([exp_id], max_results=1000)
    # the last launch trained the tune stage and the tuned main runs, not the shared-LR runs
    launched = [r.data.tags["study.run_key"] for r in everything
                if r.data.tags.get("study.lr_source") == "tune" or r.data.tags["study.role"] == "tune"]
    write_manifest_tags(client, exp_id, {"keys": launched[:-1]})
    study = read_study("tuned", uri)
    assert set(study.runs["run_key"]) | set(study.tune["run_key"]) == set(launched[:-1])
    assert len(study.shared_lr) == len(VARIANTS) * len(SCALES) * SEEDS  # an earlier launch's, kept for comparison

    shared = next(r for r in everything if r.data.tags.get("study.lr_source") == "recipe")
    client.delete_tag(shared.info.run_id, "study.lr_source")  # runs from before the tag existed
    again = read_study("tuned", uri)
    assert again.shared_lr.set_index("run_id").loc[shared.info.run_id, "lr_source"] == "recipe"


@pytest.mark.integration
def test_shared_runs_reused_as_tune_points_leave_every_shared_seed_paired_beside_the_tuned_runs(built, tmp_path):
    uri = _copy(built, tmp_path)
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("tuned").experiment_id
    everything = client.search_runs([exp_id], max_results=1000)
    # the tuning launch's keys: its tune points, its tuned main runs, and the seed-0 shared-LR runs at the tune
    # scale, which its multiple-1 points found finished under the same keys and reused
    reused = [r for r in everything if r.data.tags.get("study.lr_source") == "recipe"
              and (r.data.tags["study.scale"], r.data.tags["study.seed"]) == ("20M", "0")]
    launched = [r.data.tags["study.run_key"] for r in everything
                if r.data.tags.get("study.lr_source") == "tune" or r.data.tags["study.role"] == "tune"]
    write_manifest_tags(client, exp_id, {"keys": launched + [r.data.tags["study.run_key"] for r in reused]})
    assert len(reused) == len(VARIANTS)
    study = read_study("tuned", uri)
    assert sorted(set(zip(study.shared_lr["variant"], study.shared_lr["scale"], study.shared_lr["seed"]))) == \
        sorted((v, s, k) for v in VARIANTS for s in SCALES for k in range(SEEDS))
    result = build_report("tuned", tracking_uri=uri, out_dir=tmp_path / "r", n_resamples=99, log_to_mlflow=False)
    shared = study.shared_lr.set_index(["variant", "scale", "seed"])["val/loss"]
    pairs = {(p["metric"], p["scale"], p["variant"]): p for p in result["tuning"]["shared_vs_tuned"]}
    for scale in SCALES:
        p = pairs["val/loss", scale, "hourglass"]
        delta = np.mean([shared["hourglass", scale, k] - shared["conventional", scale, k] for k in range(SEEDS)])
        assert p["shared_delta"] == pytest.approx(delta, rel=1e-12)
        assert (p["shared_verdict"], p["tuned_verdict"], p["flip"]) == ("worse", "better", True)
    assert result["tuning"]["shared_runs"] == len(VARIANTS) * len(SCALES) * SEEDS


@pytest.mark.integration
def test_study_report_prints_the_flips_and_each_variants_compute_multiplier(full, capsys, tmp_path, monkeypatch):
    from study.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    uri, result, _ = full
    assert main(["report", "tuned", "--tracking-uri", uri, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "decided on the tuned runs" in out
    for scale in SCALES:
        assert f"flip: hourglass at {scale} on val/loss: worse at the shared LR, better tuned" in out
    for r in result["effective_compute"]["rows"]:
        if r["fitted_range"]:
            assert (f"{r['variant']}: {r['multiplier']:.2f}x compute [{r['ci_low']:.2f}, {r['ci_high']:.2f}] "
                    f"(range, {r['seeds']} seeds) over {r['scale']}") in out
