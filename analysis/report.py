"""``study report``: an experiment's runs turned into paired deltas, verdicts, fits and plots, written to
``<out_dir>/<experiment>/`` and logged to the experiment's one MLflow run named ``report`` (reused on every report).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Sequence

import pandas as pd

from analysis import run_table
from analysis.compute import effective_compute
from analysis.decide import CORRECTION, Decision, decide
from analysis.document import HEADLINE, Analysis, document
from analysis.items import item_deltas, read_items
from analysis.profile_section import FIGURE as PROFILE_FIGURE, reference_profile_section
from analysis.racing import read_race
from analysis.published import published_deltas, published_figures
from analysis.paired import PairedResult, is_higher_better, joint_bootstrap, paired_deltas
from analysis.records import as_record, json_ready
from analysis.render import Plot, to_html, to_markdown
from analysis.scaling import scaling_report
from analysis.sequential import final_decisions, read_looks
from analysis.surface import surface_report
from analysis.time_to_target import time_to_target
from analysis.tuning import TRANSFER, tune_curves, verdict_pairs
from study import schema
from study.config.decision import DecisionRule
from study.errors import StudyError
from study.track.query import open_store, runs_with_role
from study.track.store import resolve_tracking_uri, sqlite_path

REPORT_RUN_NAME = "report"
"""Name of the experiment-level MLflow run that holds the report artifacts."""

_OWN_PLOTS = ("loss_curves.png", "scaling.png", "forest_*.png", "tuning.png", "isoflop.png", "loss_tokens.png",
              PROFILE_FIGURE)


def build_report(experiment: str, baseline: str | None = None, metrics: Sequence[str] | None = None,
                 tracking_uri: str | None = None, out_dir: Path = Path("reports"), log_to_mlflow: bool = True,
                 n_resamples: int = 9999, seed: int = 0, rule: DecisionRule | None = None) -> dict:
    """Report ``experiment`` against ``baseline`` (default: the runs' ``study.baseline`` tag) on ``metrics`` (default:
    final ``val/loss`` and every ``eval/*/acc*``); returns report.json's dict with ``report_run_id``."""
    a = analyse(experiment, baseline, metrics, tracking_uri, n_resamples, seed, rule)
    out = Path(out_dir) / experiment
    out.mkdir(parents=True, exist_ok=True)
    for stale in (path for pattern in _OWN_PLOTS for path in out.glob(pattern)):
        stale.unlink()
    plots = _plots(a, out)
    profile = reference_profile_section(a.runs, a.uri, out)
    unpaired = _unpaired(a.flat)
    published = published_deltas(published_figures(experiment), a.results, a.baseline)
    # seeds, deltas and unpaired are PairedResult's last fields, so they stay the CSV's last columns
    pd.DataFrame([{**vars(r), "seeds": ";".join(map(str, r.seeds)), "deltas": ";".join(f"{d:.6g}" for d in r.deltas),
                   "unpaired": len(r.unpaired)} for r in a.flat]).to_csv(out / "pairs.csv", index=False)
    pd.DataFrame([d.to_dict() for d in a.decisions]).to_csv(out / "decisions.csv", index=False)
    blocks = document(a, unpaired, plots, published, profile.blocks)
    (out / "report.md").write_text(to_markdown(blocks), encoding="utf-8")
    (out / "report.html").write_text(to_html(blocks, f"Report: {experiment}"), encoding="utf-8")
    files = [out / "report.md", out / "report.html", out / "report.json", out / "pairs.csv",
             out / "decisions.csv"] + [p.path for p in plots.values()] + profile.files
    unlogged = {"status": f"no run logged {HEADLINE}"}
    summary = as_record({
        "experiment": experiment, "baseline": a.baseline, "metrics": a.metrics, "decision_rule": a.rule,
        "decisions": a.decisions, "looks": a.looks, "sequential": a.sequential_note or None,
        "run_notes": list(a.run_notes), "item_deltas": a.items, "results": a.flat, "joint": a.joint,
        "unpaired": unpaired, "scaling": a.scaling or unlogged, "racing": a.race,
        "surface": a.surface or ({"status": "no decay branches"} if HEADLINE in a.runs.columns else unlogged),
        "effective_compute": a.compute or unlogged, "time_to_target": a.time or unlogged,
        "tuning": {"decided_on": run_table.TUNED if a.tuned else run_table.SHARED,
                   "transfer": TRANSFER if a.tuned else None, "curves": a.tune_curves, "shared_runs": a.shared_runs,
                   "shared_vs_tuned": a.verdict_pairs, "flips": sum(p.flip for p in a.verdict_pairs)},
        "published": published, "reference_profile": profile.summary,
        "files": [str(f) for f in files], "report_run_id": None,
    })
    (out / "report.json").write_text(json.dumps(json_ready(summary), indent=2) + "\n", encoding="utf-8")
    # a SQLite store's file and its folder (the journal goes there) must be writable; any other store is asked by
    # writing to it
    db = sqlite_path(a.uri)
    if log_to_mlflow and (db is None or (os.access(db, os.W_OK) and os.access(db.parent, os.W_OK))):
        summary["report_run_id"] = _log_report_run(a.uri, experiment, a.baseline, files, a.decisions, a.runs)
    elif log_to_mlflow:
        # the files are the report: a store that can be read but not written (a shared, archived or mounted copy)
        # still gets one, and is told why its `report` run is missing
        from study.config.secrets import mask_text

        print(f"study report: the report is complete in {out}; its `report` run was not logged, because the MLflow "
              f"store {mask_text(a.uri)} cannot be written (read-only). Fix: report from a writable copy of the store "
              "to log it", file=sys.stderr)
    return json_ready(summary)


def analyse(experiment: str, baseline: str | None = None, metrics: Sequence[str] | None = None,
            tracking_uri: str | None = None, n_resamples: int = 9999, seed: int = 0, rule: DecisionRule | None = None
            ) -> Analysis:
    """Read the runs and compute every comparison (no files written); ``rule`` defaults to the experiment file's."""
    from study.plan.experiment import load_experiment

    uri = resolve_tracking_uri(tracking_uri or "")
    study = run_table.read_study(experiment, uri)
    runs = study.runs
    baseline = choose_baseline(runs, baseline)
    try:  # the experiment file (its decision: rule, its tune: grid); None where this checkout has no readable one
        declared = load_experiment(experiment)
    except StudyError:
        declared = None
    rule = rule or (declared.decision if declared is not None else DecisionRule(metric=HEADLINE))
    tuning = declared.tuning if declared is not None else None
    metrics = choose_metrics(runs, metrics)
    if rule.metric in runs.columns and rule.metric not in metrics:
        metrics = [rule.metric, *metrics]  # the primary family is decided whatever else is asked for
    results = {m: paired_deltas(runs, m, baseline, n_resamples=n_resamples, seed=seed) for m in metrics}
    joint = [j for group in _task_groups(metrics) for j in
             joint_bootstrap(runs, group, baseline, n_resamples=n_resamples, seed=seed)]
    # the seed bootstrap of the fits is a bootstrap interval too: it takes at most the resamples asked for
    n_boot = min(200, n_resamples)
    logged = HEADLINE in runs.columns
    scaling = scaling_report(runs, baseline, HEADLINE, n_boot=n_boot, seed=seed) if logged else None
    compute = (effective_compute(runs, baseline, HEADLINE, n_boot=n_boot, seed=seed, by_params=scaling.fits)
               if logged else None)
    # the branches' fits draw the L(N) fits' seeds (same n_boot and seed), so their intervals resample alike
    surface = (surface_report(study.branches, baseline, HEADLINE, n_boot=n_boot, seed=seed)
               if logged and len(study.branches) else None)
    # a run whose final value was left out as infinite (run_table) keeps its curve out of the figures too
    finished = runs.loc[(runs["status"] == run_table.FINISHED) & runs[HEADLINE].notna(), "run_id"] if logged else []
    curves = (run_table.read_curves(finished, HEADLINE, uri, trunks=run_table.trunk_links(runs)) if logged
              else pd.DataFrame())
    decisions = decide(results, rule, _baseline_means(runs, results))
    client = open_store(uri, required=True)
    exp_id = run_table.experiment_id(client, experiment)
    looks = read_looks(client, exp_id)
    note = ""
    if looks:
        # An adaptive launch decided its primary family look by look; those verdicts stand (recomputing them at
        # the nominal alpha would forget the looks already taken).
        final = final_decisions(looks)
        decisions = [Decision.from_dict(final[d.scale, d.variant]) if d.family == "primary"
                     and (d.scale, d.variant) in final else d for d in decisions]
        note = (f"The primary verdicts come from an adaptive launch with {len(looks)} looks: each row is the look "
                "that decided it (or the last), at that look's spent alpha (Bonferroni alpha spending, "
                "analysis.sequential).")
    items = (item_deltas(runs, read_items(client, runs.loc[runs["status"] == run_table.FINISHED, "run_id"]),
                         baseline, n_resamples, seed) if any(m.startswith("eval/") for m in metrics) else [])
    time = time_to_target(runs, curves, baseline, rule, uri) if logged and len(curves) else None
    shared = study.shared_lr
    pairs = (verdict_pairs(_shared_decisions(shared, baseline, metrics, rule), decisions)
             if shared is not None and baseline in set(shared["variant"]) else [])
    return Analysis(experiment, uri, baseline, metrics, runs, results, joint, scaling, n_resamples, rule, decisions,
                    looks, note, items, curves, tuned=bool((runs["lr_source"] == run_table.TUNED).any()),
                    tune_curves=tune_curves(study.tune, runs, declared=tuning.lr if tuning else None),
                    shared_runs=0 if shared is None else len(shared),
                    verdict_pairs=pairs, compute=compute, time=time, surface=surface,
                    race=read_race(client, exp_id) if len(study.branches) else None, run_notes=study.notes)


def _shared_decisions(shared: pd.DataFrame, baseline: str, metrics: Sequence[str], rule: DecisionRule
                      ) -> list[Decision]:
    """The decision table of the runs at the shared LR, on the metrics they logged (no bootstrap: it never decides)."""
    present = [m for m in metrics if m in shared.columns]
    results = {m: paired_deltas(shared, m, baseline, n_resamples=0) for m in present}
    return decide(results, rule, _baseline_means(shared, results))


def _baseline_means(runs: pd.DataFrame, results: dict[str, list[PairedResult]]) -> dict:
    """(metric, scale, variant) -> the baseline's mean over the seeds of that comparison (the % column)."""
    out = {}
    for metric, rs in results.items():
        for r in rs:
            base = runs[(runs["scale"] == r.scale) & (runs["variant"] == r.baseline) & runs["seed"].isin(r.seeds)
                        & (runs["status"] == run_table.FINISHED)]
            newest = base.sort_values("start_time").drop_duplicates("seed", keep="last")
            if len(newest):
                out[metric, r.scale, r.variant] = float(newest[metric].mean())
    return out


def choose_baseline(runs: pd.DataFrame, baseline: str | None) -> str:
    """The requested baseline, else the one the runs' ``study.baseline`` tags agree on; checked against the variants."""
    variants = sorted(runs["variant"].unique())
    if baseline is None:
        tagged = Counter(runs["baseline"].dropna())
        if len(tagged) != 1:
            problem = (f"no run carries a {schema.TAG_BASELINE} tag" if not tagged
                       else f"runs name different baselines ({dict(tagged)})")
            raise StudyError("baseline", problem, f"pass --baseline with one of: {', '.join(variants)}")
        baseline = next(iter(tagged))
    if baseline not in variants:
        raise StudyError("baseline", f"no runs of variant {baseline!r} in this experiment",
                         f"choose one of: {', '.join(variants)}")
    return baseline


def choose_metrics(runs: pd.DataFrame, metrics: Sequence[str] | None) -> list[str]:
    """The requested metrics (checked), else final val/loss plus every ``eval/*/acc*`` the runs logged."""
    present = sorted(c for c in runs.columns if "/" in c)
    if metrics:
        for metric in metrics:
            if metric not in present:
                raise StudyError("metric", f"no run of this experiment logged {metric!r}",
                                 f"choose from: {', '.join(present) or '(none logged yet)'}")
        return list(dict.fromkeys(metrics))
    chosen = [HEADLINE] if HEADLINE in present else []
    # scores, not their standard errors (lm-eval reports both under eval/<task>/)
    chosen += [m for m in present if m.startswith("eval/") and m.rsplit("/", 1)[-1].startswith("acc")
               and not m.endswith("_stderr")]
    if not chosen:
        raise StudyError("metric", f"no run logged {HEADLINE} or an eval/*/acc metric yet",
                         "wait for the runs to log them, or pass --metric with one of: "
                         + (", ".join(present) or "(none)"))
    return chosen


def _task_groups(metrics: Sequence[str]) -> list[list[str]]:
    """``eval/<task>/<name>`` metrics grouped by name (acc with acc, acc_norm with acc_norm), two tasks or more."""
    groups: dict[str, list[str]] = {}
    for metric in metrics:
        parts = metric.split("/")
        if len(parts) == 3 and parts[0] == "eval":
            groups.setdefault(parts[2], []).append(metric)
    return [g for g in groups.values() if len(g) >= 2 and len({is_higher_better(m) for m in g}) == 1]


def _plots(a: Analysis, out: Path) -> dict[str, Plot]:
    """The figures by the place they take in the report (analysis.document)."""
    from analysis.plots import (plot_decisions, plot_isoflops, plot_loss_curves, plot_loss_tokens, plot_scaling,
                                plot_tuning)

    plots = {}
    for family in ("primary", "secondary"):
        decided = [d for d in a.decisions if d.family == family and d.n > 0]
        if decided:
            name = f"forest_{a.rule.metric.replace('/', '_')}.png" if family == "primary" else "forest_secondary.png"
            metrics = ", ".join(dict.fromkeys(d.metric for d in decided))
            plots["decisions" if family == "primary" else "secondary"] = Plot(
                plot_decisions(decided, out / name),
                f"Paired Δ against {a.baseline} of final {metrics}: mean and the multiplicity-adjusted t interval "
                f"the verdict uses ({CORRECTION[family]}), coloured by verdict"
                + (", the equivalence margin shaded" if any(d.margin for d in decided) else ""))
    if a.scaling is not None and any(f.form != "none" for f in a.scaling.fits.values()):
        path = plot_scaling(a.runs, a.scaling, out / "scaling.png", a.results.get(HEADLINE, []))
        plots["scaling"] = Plot(path, f"Final {HEADLINE} against counted parameters with per-variant fits, and each "
                                      f"variant's fitted gap to {a.baseline}")
    surface = a.surface
    if surface is not None and surface.isoflops:
        plots["surface"] = Plot(plot_isoflops(surface, out / "isoflop.png"),
                                f"Fitted L(N, D) of each arm along the iso-FLOP line of each scale's planned compute: "
                                f"final {HEADLINE} against counted parameters N (D = compute / FLOPs per token), the "
                                "compute-optimal N marked ●, the planned run ×")
    elif surface is not None and any(f.form != "none" for f in surface.fits):
        plots["surface"] = Plot(plot_loss_tokens(surface, out / "loss_tokens.png"),
                                f"Final {HEADLINE} of every branch end against its training tokens per scale, with "
                                "each arm's fitted L(D)")
    if len(a.curves):
        plots["loss_curves"] = Plot(plot_loss_curves(a.runs, a.curves, a.baseline, out / "loss_curves.png"),
                                    f"{HEADLINE} against step per scale: mean over finished seeds, band ± 1 sd")
    if a.tune_curves:
        path = plot_tuning(a.tune_curves, a.baseline, out / "tuning.png")
        plots["tuning"] = Plot(path, f"Tuning curves: final {HEADLINE} of each tune run against its peak LR, the mean "
                                     "over seeds and the LR each variant's main runs took")
    return plots


def _unpaired(results: list[PairedResult]) -> list[dict]:
    """Each unpaired run once per reason, with the metrics it is missing from."""
    merged: dict[tuple, dict] = {}
    for r in results:
        for u in r.unpaired:
            entry = merged.setdefault((u.run_id, u.variant, u.scale, u.seed, u.reason), {**vars(u), "metrics": []})
            if r.metric not in entry["metrics"]:
                entry["metrics"].append(r.metric)
    return list(merged.values())


REPORT_RUNS_TAG, REPORT_RUNS_ARTIFACT, REPORT_LINK_TAG = "study.report.runs", "runs.json", "study.report_run_id"


def _log_report_run(uri: str, experiment: str, baseline: str, files: list[Path], decisions: list[Decision],
                    runs: pd.DataFrame) -> str:
    """Upload the files to the experiment's single report run (created the first time), with the verdicts as tags
    (``study.verdict.[<metric>.]<scale>.<variant>``) and the runs it read linked both ways (``runs.json`` and the
    count tag on it, ``study.report_run_id`` on each of them)."""
    mlflow_client = open_store(uri, required=True)
    exp_id = run_table.experiment_id(mlflow_client, experiment)
    found = runs_with_role(mlflow_client, [exp_id], schema.ROLE_REPORT, order_by=["attributes.start_time ASC"],
                           max_results=1)
    if found:
        run_id = found[0].info.run_id
    else:
        tags = {schema.TAG_ROLE: schema.ROLE_REPORT, schema.TAG_EXPERIMENT: experiment}
        run_id = mlflow_client.create_run(exp_id, run_name=REPORT_RUN_NAME, tags=tags).info.run_id
    from mlflow.entities import RunTag

    tags = [RunTag(schema.TAG_BASELINE, baseline)]
    for d in decisions:
        where = f"{d.scale}.{d.variant}" if d.family == "primary" else f"{d.metric}.{d.scale}.{d.variant}"
        tags.append(RunTag(f"study.verdict.{where}", d.verdict))
    counts = Counter(d.verdict for d in decisions if d.family == "primary")
    tags.append(RunTag("study.verdicts", ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "none"))
    used = runs[["run_id", "run_key", "variant", "scale", "seed", "status"]].to_dict("records")
    tags.append(RunTag(REPORT_RUNS_TAG, str(len(used))))
    for start in range(0, len(tags), 100):
        mlflow_client.log_batch(run_id, tags=tags[start:start + 100])
    for path in files:
        mlflow_client.log_artifact(run_id, str(path))
    mlflow_client.log_dict(run_id, json_ready({"runs": used}), REPORT_RUNS_ARTIFACT)
    for row in used:
        mlflow_client.set_tag(row["run_id"], REPORT_LINK_TAG, run_id)
    mlflow_client.set_terminated(run_id, "FINISHED")
    return run_id
