"""`study report` end to end on a real SQLite MLflow store filled with schema-conforming synthetic runs."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from analysis.report import build_report
from analysis.run_table import read_runs
from benchmarks.synthetic_store import synthetic_store
from conftest import new_store
from study.errors import StudyError

# one worker builds the module's expensive fixtures once (xdist would build them on each worker it splits onto)
pytestmark = pytest.mark.xdist_group("report")

EXPERIMENT = "ffn_shape"
VARIANTS = ["conventional", "hourglass", "tapered"]
SCALES = ["20M", "40M", "80M", "160M"]
STATUSES = {("hourglass", "40M", 2): "FAILED", ("tapered", "80M", 1): "MISSING", ("tapered", "160M", 0): "RUNNING"}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("store")
    uri = new_store(root / "mlflow.db")
    synthetic_store(uri, EXPERIMENT, VARIANTS, SCALES, seeds=3, steps=40, eval_tasks=("arc_easy", "piqa"),
                    effects={"conventional": 0.0, "hourglass": -0.03, "tapered": 0.0}, statuses=STATUSES)
    return uri


@pytest.fixture(scope="module")
def first_report(store, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("reports")
    return build_report(EXPERIMENT, tracking_uri=store, out_dir=out, n_resamples=999), out / EXPERIMENT


@pytest.mark.integration
def test_runs_are_read_one_row_per_training_run_with_finals_and_status(store, first_report):
    runs = read_runs(EXPERIMENT, store)
    assert len(runs) == len(VARIANTS) * len(SCALES) * 3 - 1  # one MISSING; the report run is not a training run
    assert runs["seed"].dtype.kind == "i" and runs["params_counted"].dtype.kind == "i"
    assert set(runs["status"]) == {"FINISHED", "FAILED", "RUNNING"}
    assert set(runs["baseline"]) == {"conventional"} and set(runs["role"]) == {"train"}
    assert {"val/loss", "val/ppl", "train/loss", "eval/arc_easy/acc", "eval/piqa/acc_norm"} <= set(runs.columns)
    finished = runs[runs["status"] == "FINISHED"]
    assert finished[["val/loss", "eval/piqa/acc"]].notna().all().all()
    assert (finished["val/ppl"] - finished["val/loss"].map(math.exp)).abs().max() < 1e-9


def test_report_answers_with_paired_deltas_for_loss_and_accuracy(store, first_report):
    result, _ = first_report
    assert result["baseline"] == "conventional"  # from the study.baseline tag
    assert result["metrics"] == ["val/loss", "eval/arc_easy/acc", "eval/arc_easy/acc_norm", "eval/piqa/acc",
                                 "eval/piqa/acc_norm"]
    required = {"scale", "variant", "baseline", "metric", "n", "mean_delta", "sd_delta", "ci_low", "ci_high",
                "boot_ci_low", "boot_ci_high", "p_wilcoxon", "win_rate"}
    assert all(required <= set(r) for r in result["results"])
    assert len(result["results"]) == 5 * len(SCALES) * 2
    json.dumps(result, allow_nan=False)

    runs = read_runs(EXPERIMENT, store).set_index(["variant", "scale", "seed"])
    by_key = {(r["metric"], r["scale"], r["variant"]): r for r in result["results"]}
    r = by_key["val/loss", "20M", "hourglass"]
    direct = [runs.loc[("hourglass", "20M", k), "val/loss"] - runs.loc[("conventional", "20M", k), "val/loss"]
              for k in range(3)]
    assert r["n"] == 3 and r["mean_delta"] == pytest.approx(sum(direct) / 3, rel=1e-12)
    assert r["ci_low"] < r["mean_delta"] < r["ci_high"] < 0  # a 0.03 effect against 0.004 run noise
    assert by_key["val/loss", "40M", "hourglass"]["n"] == 2  # seed 2 FAILED
    acc = by_key["eval/arc_easy/acc", "160M", "hourglass"]
    gains = [runs.loc[("hourglass", "160M", k), "eval/arc_easy/acc"]
             - runs.loc[("conventional", "160M", k), "eval/arc_easy/acc"] for k in range(3)]
    assert acc["win_rate"] == pytest.approx(sum(g > 0 for g in gains) / 3)  # higher accuracy wins
    assert acc["mean_delta"] == pytest.approx(sum(gains) / 3, rel=1e-12) and acc["mean_delta"] > 0
    assert result["scaling"]["fits"]["hourglass"]["form"] == "E + A*N^-alpha"
    assert {j["scale"] for j in result["joint"]} == set(SCALES)


def test_unpaired_and_unfinished_runs_are_reported(first_report):
    result, out = first_report
    reasons = {(u["variant"], u["scale"], u["seed"], u["reason"]) for u in result["unpaired"]}
    assert ("hourglass", "40M", 2, "status FAILED: synthetic: loss became NaN") in reasons
    assert ("conventional", "40M", 2, "no usable hourglass run with seed 2") in reasons
    assert ("conventional", "80M", 1, "no usable tapered run with seed 1") in reasons
    assert ("tapered", "160M", 0, "status RUNNING") in reasons
    md = (out / "report.md").read_text()
    assert "| hourglass-40M-s2 | FAILED |" in md and "| tapered-160M-s0 | RUNNING |" in md


def test_report_files_hold_the_tables_and_the_html_embeds_every_plot(first_report):
    result, out = first_report
    names = {Path(f).name for f in result["files"]}
    pngs = sorted(out.glob("*.png"))
    # one forest of the primary family, one small-multiple forest of the four secondary metrics
    assert {"report.md", "report.html", "report.json", "pairs.csv", "loss_curves.png", "scaling.png",
            "forest_val_loss.png", "forest_secondary.png"} <= names
    assert {p.name for p in pngs} <= names and len(pngs) == 4

    md = (out / "report.md").read_text()
    assert "| variant | seeds | val/loss (mean ± sd) | PPL | Δ vs conventional | t 95% CI (unadjusted) |" in md
    assert "### Scale 160M" in md and "![" in md

    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs)
    for png in pngs:
        assert base64.b64encode(png.read_bytes()).decode() in page
    assert "http://" not in page and "https://" not in page and "<link" not in page and "<script" not in page

    pairs = pd.read_csv(out / "pairs.csv")
    assert len(pairs) == len(result["results"])
    row = pairs[(pairs["metric"] == "val/loss") & (pairs["scale"] == "20M") & (pairs["variant"] == "hourglass")]
    expected = next(r for r in result["results"]
                    if (r["metric"], r["scale"], r["variant"]) == ("val/loss", "20M", "hourglass"))
    assert row["mean_delta"].item() == pytest.approx(expected["mean_delta"], rel=1e-12)
    assert row["boot_ci_high"].item() == pytest.approx(expected["boot_ci_high"], rel=1e-12)


def test_report_opens_with_a_sentence_per_scale_the_forest_and_a_compact_table_and_folds_the_rest(first_report):
    result, out = first_report
    md = (out / "report.md").read_text()
    primary = {(d["scale"], d["variant"]): d for d in result["decisions"] if d["family"] == "primary"}
    won = primary["160M", "hourglass"]  # the planted 0.03 lower loss, decided at 160M
    assert won["verdict"] == "better" and won["adj_ci_high"] < 0
    # the interval beside the verdict is the Holm-adjusted one it agrees with
    assert (f"At 160M: hourglass better by {-won['mean_delta']:.3g} nats [{-won['adj_ci_high']:.3g}, "
            f"{-won['adj_ci_low']:.3g}]; tapered undecided (Holm-adjusted p ") in md
    short = primary["40M", "hourglass"]  # seed 2 failed: 2 pairs, too few for Holm at 8 comparisons
    more = short["seeds_to_decide"] - 2
    assert short["verdict"] == "undecided" and short["n"] == 2 and more > 0
    assert (f"At 40M: hourglass undecided (Holm-adjusted p {short['p_adjusted']:.3g}), "
            f"{short['seeds_to_decide']} seed pairs ({more} more) would probably decide it;") in md
    compact = "| scale | variant | Δ | t CI, Holm-adjusted | p (Holm) | Δ % | verdict | seed pairs to decide |"
    full = ("| scale | variant | n | Δ | Δ % | t CI (unadjusted) | t CI (adjusted) | p (adj.) | sign-flip p | "
            "Wilcoxon p | d_z |")
    order = ["## Decisions on final val/loss", "At 20M: ", "At 160M: ", "(forest_val_loss.png)", compact,
             "<details><summary>Every statistic of the 8 primary comparisons", full, "</details>",
             "## Scaling of final val/loss", "(scaling.png)", "## Secondary metrics", "(forest_secondary.png)",
             "<details><summary>Every statistic of the 32 secondary comparisons", "## Final val/loss per scale"]
    assert [md.index(s) for s in order] == sorted(md.index(s) for s in order)
    page = (out / "report.html").read_text()
    assert page.count("<details>") == md.count("<details>") == 3  # primary, secondary, the descriptive deltas
    assert '<td class="better">better</td>' in page
    # nothing the full tables show is lost from the files
    csv = pd.read_csv(out / "decisions.csv")
    assert len(csv) == len(result["decisions"]) == 8 + 32
    assert {"p_adjusted", "p_signflip", "p_wilcoxon", "d_z", "mde", "p_tost_adjusted", "seeds_to_decide"} <= set(csv)


def test_a_store_without_tune_runs_reports_compute_and_time_at_the_shared_lr_and_no_tuning(first_report):
    result, out = first_report
    assert result["tuning"] == {"decided_on": "recipe", "transfer": None, "curves": [], "shared_runs": 0,
                                "shared_vs_tuned": [], "flips": 0}
    compute = result["effective_compute"]
    assert compute["source"] == "resolved.flops_per_token x recipe.tokens" and compute["status"] == "ok"
    assert {(r["variant"], r["scale"]) for r in compute["rows"]} == {
        (v, s) for v in ("hourglass", "tapered") for s in [*SCALES, "20M–160M"]}
    # the only planted difference is hourglass's 0.03 lower loss at equal compute: it is worth more than its compute
    hourglass = next(r for r in compute["rows"] if r["variant"] == "hourglass" and r["fitted_range"])
    assert 1 < hourglass["ci_low"] <= hourglass["multiplier"] <= hourglass["ci_high"]
    times = {(r["scale"], r["variant"]): r for r in result["time_to_target"]["rows"]}
    assert times["20M", "hourglass"]["ratio"] < 1 and times["20M", "hourglass"]["reached"] == 3
    md = (out / "report.md").read_text()
    assert "## Effective compute" in md and "## Time to target" in md
    assert "## Tuning curves" not in md and "Decided on the tuned runs" not in md and "Shared LR" not in md


@pytest.mark.integration
def test_rereport_reuses_the_single_report_run(store, first_report, tmp_path):
    from mlflow.tracking import MlflowClient

    first, _ = first_report
    again = build_report(EXPERIMENT, baseline="tapered", metrics=["val/loss"], tracking_uri=store,
                         out_dir=tmp_path, n_resamples=99)
    assert again["report_run_id"] == first["report_run_id"] is not None
    assert {r["baseline"] for r in again["results"]} == {"tapered"}

    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name(EXPERIMENT)
    reports = client.search_runs([exp.experiment_id], filter_string="tags.`study.role` = 'report'")
    assert [r.info.run_id for r in reports] == [first["report_run_id"]]
    assert reports[0].info.run_name == "report" and reports[0].data.tags["study.baseline"] == "tapered"
    artifacts = {a.path for a in client.list_artifacts(first["report_run_id"])}
    assert {"report.md", "report.html", "report.json", "pairs.csv", "scaling.png", "forest_val_loss.png"} <= artifacts


def test_bad_experiment_baseline_or_metric_raise_study_errors_with_choices(store, tmp_path):
    with pytest.raises(StudyError) as err:
        build_report("no_such_study", tracking_uri=store, out_dir=tmp_path)
    assert err.value.field == "experiment" and EXPERIMENT in err.value.fix
    with pytest.raises(StudyError) as err:
        build_report(EXPERIMENT, baseline="uniform", tracking_uri=store, out_dir=tmp_path)
    assert err.value.field == "baseline" and "conventional, hourglass, tapered" in err.value.fix
    with pytest.raises(StudyError) as err:
        build_report(EXPERIMENT, metrics=["eval/hellaswag/acc"], tracking_uri=store, out_dir=tmp_path)
    assert err.value.field == "metric" and "eval/arc_easy/acc" in err.value.fix
    with pytest.raises(StudyError) as err:
        build_report(EXPERIMENT, tracking_uri=f"sqlite:///{tmp_path / 'absent.db'}", out_dir=tmp_path)
    assert err.value.field == "tracking_uri" and not (tmp_path / "absent.db").exists()
    assert not list(tmp_path.iterdir())


@pytest.mark.integration
def test_report_reads_the_store_named_by_the_environment(store, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    result = build_report(EXPERIMENT, metrics=["val/loss"], out_dir=tmp_path, log_to_mlflow=False, n_resamples=99)
    assert result["report_run_id"] is None and (tmp_path / EXPERIMENT / "report.html").exists()


@pytest.mark.integration
def test_the_papers_440m_geometry_deltas_are_shown_beside_ours_in_nats(tmp_path):
    uri = new_store(tmp_path / "mlflow.db")
    # our effects: near the paper's for geometry and cosine; anti has no published counterpart
    synthetic_store(uri, "geometry", ["uniform", "cosine", "geometry", "anti"], {"440M": 438_867_456}, seeds=5,
                    steps=20, eval_tasks=(), baseline="uniform",
                    effects={"uniform": 0.0, "cosine": -0.003, "geometry": -0.019, "anti": -0.2},
                    seed_sd=0.02, run_sd=0.002)
    result = build_report("geometry", tracking_uri=uri, out_dir=tmp_path / "reports", n_resamples=499,
                          log_to_mlflow=False)
    rows = {p["variant"]: p for p in result["published"]}
    # the paper's anti-topological/raw control is another design than our anti: it is no target of ours
    assert set(rows) == {"cosine", "geometry"} and all(p["scale"] == "440M" for p in rows.values())
    assert rows["geometry"]["paper_delta_nats"] == pytest.approx(3.430 - 3.449)  # losses: a plain difference
    by_variant = {r["variant"]: r for r in result["results"] if r["metric"] == "val/loss"}
    for variant, p in rows.items():  # our side of each row is the report's own paired result
        ours = by_variant[variant]
        assert p["ours"] == ours["mean_delta"] and (p["ci_low"], p["ci_high"]) == (ours["ci_low"], ours["ci_high"])
        assert p["consistent"] == (ours["ci_low"] <= p["paper_delta_nats"] <= ours["ci_high"])
        assert p["verified"] is False and p["variant_source"].startswith("arXiv 2608.02064")
    text = (tmp_path / "reports" / "geometry" / "report.md").read_text()
    assert "Published figures beside ours, as deltas in nats" in text
    assert "| 440M | geometry | 3.449 → 3.430 (val/loss) | -0.0190 |" in text


@pytest.mark.integration
def test_a_malformed_seed_tag_and_an_infinite_final_loss_are_named_and_left_out(tmp_path, capsys):
    from mlflow import MlflowClient

    from study.cli import main

    uri = new_store(tmp_path / "mlflow.db")
    ids = synthetic_store(uri, "faulty", ["conventional", "hourglass"], ["20M", "40M", "80M"], seeds=3, steps=20,
                          eval_tasks=(), effects={"conventional": 0.0, "hourglass": -0.03})
    client = MlflowClient(uri)
    by_id = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("faulty").experiment_id])}
    runs = {(r.data.tags["study.variant"], r.data.tags["study.scale"], r.data.tags["study.seed"]): r
            for r in by_id.values() if r.info.run_id in ids}
    tags = {("hourglass", "20M", "0"): "x", ("hourglass", "40M", "1"): "", ("conventional", "80M", "2"): "1.5"}
    for cell, tag in tags.items():
        client.set_tag(runs[cell].info.run_id, "study.seed", tag)
    diverged = runs["hourglass", "80M", "0"]
    client.log_metric(diverged.info.run_id, "val/loss", math.inf, step=10_000)
    assert client.get_run(diverged.info.run_id).data.metrics["val/loss"] == 1.7976931348623157e+308  # SQL's inf

    capsys.readouterr()
    assert main(["report", "faulty", "--tracking-uri", uri, "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "faulty" / "report.json").read_text())
    seeds_note, loss_note = result["run_notes"][:2]
    assert seeds_note == ("Left out 3 run(s) whose study.seed tag is not a whole number: "
                          + ", ".join(f"{runs[c].info.run_name} (study.seed={t!r})" for c, t in sorted(
                              tags.items(), key=lambda item: str(runs[item[0]].info.run_name)))
                          + "; set the tag to the run's seed in MLflow, or delete the run")
    assert loss_note.startswith("Left out of the comparisons and figures on those metrics, as not reached: 1 run(s) "
                                f"whose final value is infinite or NaN (the run diverged): {diverged.info.run_name} "
                                "(val/loss = inf")
    read = read_runs("faulty", uri)
    assert len(read) == 18 - 3 and read.loc[read["run_id"] == diverged.info.run_id, "val/loss"].isna().all()
    at_80m = next(r for r in result["results"] if (r["metric"], r["scale"], r["variant"]) == ("val/loss", "80M",
                                                                                              "hourglass"))
    assert at_80m["n"] == 1 and at_80m["seeds"] == [1]  # seed 0 diverged, seed 2's baseline lost its seed tag
    md = (tmp_path / "out" / "faulty" / "report.md").read_text()
    assert seeds_note in md and diverged.info.run_name in md
    assert {"loss_curves.png", "scaling.png"} <= {p.name for p in (tmp_path / "out" / "faulty").glob("*.png")}


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_report_out_that_cannot_take_the_report_is_refused_naming_out_and_nothing_is_written(store, tmp_path, where,
                                                                                             capsys):
    import os

    from study.cli import main

    blocker = tmp_path / "blocker"
    if where == "read-only":
        blocker.mkdir()
        os.chmod(blocker, 0o555)
        out = blocker / "reports"
    else:
        blocker.write_text("not a folder")
        out = blocker if where == "a file" else blocker / "reports"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    try:
        if where == "read-only" and os.access(blocker, os.W_OK):
            pytest.skip("this user writes in read-only folders (root)")
        capsys.readouterr()
        assert main(["report", EXPERIMENT, "--tracking-uri", store, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "error in `--out`" in err and str(blocker) in err
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    finally:
        os.chmod(blocker, 0o755) if blocker.is_dir() else None


@pytest.mark.integration
def test_a_store_on_a_read_only_file_system_gets_its_report_and_is_told_why_no_report_run_was_logged(store, tmp_path,
                                                                                                   capsys):
    """`study report` of a store that can be read but not written (here a read-only bind mount of a copy): the
    report's files are all written, the command exits 0 and says on its standard error why the store has no `report`
    run and how to get one; the store is left as it was."""
    import os
    import shutil
    import subprocess

    from study.cli import main

    folder = tmp_path / "shelf"
    folder.mkdir()
    shutil.copyfile(store.removeprefix("sqlite:///"), folder / "mlflow.db")
    before = (folder / "mlflow.db").read_bytes()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(folder), str(folder)]).returncode:
        pytest.skip("a read-only bind mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        capsys.readouterr()
        assert main(["report", EXPERIMENT, "--tracking-uri", f"sqlite:///{folder}/mlflow.db", "--out",
                     str(tmp_path / "out")]) == 0
        err = " ".join(capsys.readouterr().err.split())
        assert (f"its `report` run was not logged, because the MLflow store sqlite:///{folder}/mlflow.db cannot be "
                "written (read-only). Fix: report from a writable copy of the store to log it") in err
        assert "Traceback" not in err
        written = json.loads((tmp_path / "out" / EXPERIMENT / "report.json").read_text())
        assert written["report_run_id"] is None and {"report.md", "report.html", "pairs.csv"} <= {
            p.name for p in (tmp_path / "out" / EXPERIMENT).iterdir()}
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)
    assert (folder / "mlflow.db").read_bytes() == before
