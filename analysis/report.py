"""``study report``: an experiment's runs turned into paired deltas, intervals, scaling fits and plots.

Writes ``<out_dir>/<experiment>/`` (report.md, self-contained report.html, report.json, pairs.csv, PNGs) and
logs the same files to one experiment-level MLflow run named ``report`` (tag ``study.stage=report``), reused
every time the experiment is reported again.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import pandas as pd

from analysis import runs as store
from analysis.published import published_deltas, published_figures
from analysis.paired import (CONFIDENCE, JointResult, PairedResult, is_higher_better, joint_bootstrap, json_ready,
                             paired_deltas)
from analysis.render import Block, Heading, Paragraph, Plot, Table, to_html, to_markdown
from analysis.scaling import ScalingReport, scaling_report
from study.errors import StudyError
from study.track.store import resolve_tracking_uri

HEADLINE = "val/loss"
"""The metric of the headline table and of the scaling fit, when the runs logged it."""

REPORT_RUN_NAME = "report"
"""Name of the experiment-level MLflow run that holds the report artifacts."""

_OWN_PLOTS = ("loss_curves.png", "scaling.png", "forest_*.png")


@dataclass(frozen=True)
class Analysis:
    """Everything the report says about one experiment, before it is written anywhere."""

    experiment: str
    """MLflow experiment name."""
    uri: str
    """Tracking URI it was read from."""
    baseline: str
    """Variant every delta is measured against."""
    metrics: list[str]
    """Final metrics compared; the first heads the report."""
    runs: pd.DataFrame
    """One row per training run (analysis.runs.read_runs)."""
    results: dict[str, list[PairedResult]]
    """Paired deltas per metric."""
    joint: list[JointResult]
    """Mean-across-tasks deltas."""
    scaling: ScalingReport | None
    """Scaling fits of val/loss, when logged."""
    n_resamples: int
    """Bootstrap resamples per interval."""

    @property
    def flat(self) -> list[PairedResult]:
        """Every paired result, metric by metric."""
        return [r for m in self.metrics for r in self.results[m]]


def build_report(
    experiment: str,
    baseline: str | None = None,
    metrics: Sequence[str] | None = None,
    tracking_uri: str | None = None,
    out_dir: Path = Path("reports"),
    log_to_mlflow: bool = True,
    n_resamples: int = 9999,
    seed: int = 0,
) -> dict:
    """Report ``experiment`` against ``baseline`` (default: the runs' ``study.baseline`` tag).

    ``metrics`` default to the final ``val/loss`` plus every ``eval/*/acc*`` present. Returns
    ``{"experiment", "baseline", "metrics", "results", "joint", "unpaired", "scaling", "files", "report_run_id"}``.
    """
    a = analyse(experiment, baseline, metrics, tracking_uri, n_resamples, seed)
    out = Path(out_dir) / experiment
    out.mkdir(parents=True, exist_ok=True)
    for pattern in _OWN_PLOTS:
        for stale in out.glob(pattern):
            stale.unlink()
    plots = _plots(a, out)
    unpaired = _unpaired(a.flat)
    published = published_deltas(published_figures(experiment), a.results, a.baseline)
    pd.DataFrame([_csv_row(r) for r in a.flat]).to_csv(out / "pairs.csv", index=False)
    blocks = _document(a, unpaired, plots, published)
    (out / "report.md").write_text(to_markdown(blocks), encoding="utf-8")
    (out / "report.html").write_text(to_html(blocks, f"Report: {experiment}"), encoding="utf-8")
    files = [out / "report.md", out / "report.html", out / "report.json", out / "pairs.csv"] + [p.path for p in plots]
    summary = {
        "experiment": experiment, "baseline": a.baseline, "metrics": a.metrics,
        "results": [r.to_dict() for r in a.flat], "joint": [j.to_dict() for j in a.joint], "unpaired": unpaired,
        "scaling": a.scaling.to_dict() if a.scaling else {"status": f"no run logged {HEADLINE}"},
        "published": [p.to_dict() for p in published],
        "files": [str(f) for f in files], "report_run_id": None,
    }
    (out / "report.json").write_text(json.dumps(json_ready(summary), indent=2) + "\n", encoding="utf-8")
    if log_to_mlflow:
        summary["report_run_id"] = _log_report_run(a.uri, experiment, a.baseline, files)
    return json_ready(summary)


def analyse(
    experiment: str, baseline: str | None = None, metrics: Sequence[str] | None = None,
    tracking_uri: str | None = None, n_resamples: int = 9999, seed: int = 0,
) -> Analysis:
    """Read the runs and compute every comparison; no files are written."""
    uri = resolve_tracking_uri(tracking_uri or "")
    runs = store.read_runs(experiment, uri)
    baseline = choose_baseline(runs, baseline)
    metrics = choose_metrics(runs, metrics)
    results = {m: paired_deltas(runs, m, baseline, n_resamples=n_resamples, seed=seed) for m in metrics}
    joint = [j for group in _task_groups(metrics) for j in
             joint_bootstrap(runs, group, baseline, n_resamples=n_resamples, seed=seed)]
    scaling = scaling_report(runs, baseline, HEADLINE, seed=seed) if HEADLINE in runs.columns else None
    return Analysis(experiment, uri, baseline, metrics, runs, results, joint, scaling, n_resamples)


def choose_baseline(runs: pd.DataFrame, baseline: str | None) -> str:
    """The requested baseline, else the one the runs' ``study.baseline`` tags agree on; checked against the variants."""
    variants = sorted(runs["variant"].unique())
    if baseline is None:
        tagged = Counter(runs["baseline"].dropna())
        if len(tagged) != 1:
            problem = ("no run carries a study.baseline tag" if not tagged
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


def _plots(a: Analysis, out: Path) -> list[Plot]:
    from analysis.plots import plot_forest, plot_loss_curves, plot_scaling

    plots = []
    finished = a.runs.loc[a.runs["status"] == store.FINISHED, "run_id"]
    if HEADLINE in a.runs.columns and len(finished):
        curves = store.read_curves(finished, HEADLINE, a.uri)
        if len(curves):
            plots.append(Plot(plot_loss_curves(a.runs, curves, a.baseline, out / "loss_curves.png"),
                              f"{HEADLINE} against step per scale: mean over finished seeds, band ± 1 sd"))
    for metric, rs in a.results.items():
        if any(r.n > 0 for r in rs):
            path = plot_forest(rs, out / f"forest_{_slug(metric)}.png")
            plots.append(Plot(path, f"Paired deltas of final {metric} against {a.baseline}: thin = t 95% CI, "
                                    "thick = bootstrap 95% CI"))
    if a.scaling is not None and a.scaling.fits:
        path = plot_scaling(a.runs, a.scaling, out / "scaling.png", a.results.get(HEADLINE, []))
        plots.append(Plot(path, f"Final {HEADLINE} against counted parameters with per-variant fits, and each "
                                f"variant's fitted gap to {a.baseline}"))
    return plots


def _document(a: Analysis, unpaired: list[dict], plots: list[Plot], published: list | None = None) -> list[Block]:
    statuses = Counter(a.runs["status"])
    headline = a.metrics[0]
    blocks: list[Block] = [
        Heading(f"Report: {a.experiment}", 1),
        Paragraph(f"Baseline {a.baseline}. {len(a.runs)} training runs ("
                  + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
                  + f"). Metrics: {', '.join(a.metrics)}. Store: {_without_credentials(a.uri)}. "
                  f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC."),
        Heading(f"Headline: final {headline} per scale"),
        Paragraph(f"Mean ± sd over finished seeds; Δ is the paired mean of variant − {a.baseline} over seeds "
                  f"that both finished (negative = lower). Intervals are {CONFIDENCE:.0%}. Verdict: better or "
                  "worse when the t interval excludes 0, unclear when it does not."),
    ]
    for scale in store.scale_order(a.runs):
        blocks += _headline(a.runs, a.results[headline], headline, a.baseline, scale)
    blocks.append(Heading("Paired deltas, every metric"))
    for metric, rs in a.results.items():
        blocks += [Heading(f"{metric} ({'higher' if is_higher_better(metric) else 'lower'} is better)", 3),
                   _deltas_table(rs)]
    if a.joint:
        blocks += [Heading("Mean across downstream tasks (joint bootstrap)"),
                   Paragraph("Δ averaged over the tasks listed; each bootstrap draw resamples seeds once for all "
                             "tasks, so tasks that move together widen the interval as they should."),
                   _joint_table(a.joint)]
    if published:
        blocks += [Heading("The paper's figures beside ours"),
                   Paragraph(f"{published[0].source}. Paper Δ = its variant − its {a.baseline}; ours is the paired "
                             f"mean Δ with its t {CONFIDENCE:.0%} interval."),
                   Table(["scale", "variant", "metric", f"paper {a.baseline}", "paper variant", "paper Δ", "our Δ",
                          "our t CI", "paper Δ inside"],
                         [[p.scale, p.variant, p.metric, _num(p.paper_baseline), _num(p.paper_variant),
                           _signed(p.paper_delta), _signed(p.ours), _ci(p.ci_low, p.ci_high),
                           {True: "yes", False: "no", None: "—"}[p.contains]] for p in published])]
    if a.scaling is not None:
        blocks += [Heading(f"Scaling fits of final {a.scaling.metric}"), _scaling_table(a.scaling)]
    blocks += _missing(a.runs, unpaired, a.metrics)
    blocks += [Heading("Figures"), *plots, Heading("Method"),
               Paragraph(_METHOD.format(n_resamples=a.n_resamples))]
    return blocks


def _headline(runs: pd.DataFrame, results: list[PairedResult], metric: str, baseline: str, scale: str
              ) -> list[Block]:
    at_scale = runs[(runs["scale"] == scale) & (runs["status"] == store.FINISHED) & runs[metric].notna()]
    by_variant = {r.variant: r for r in results if r.scale == scale}
    loss_like = metric.endswith("/loss")
    header = ["variant", "seeds", f"{metric} (mean ± sd)"] + (["PPL"] if loss_like else []) + [
        "Δ vs " + baseline, "t 95% CI", "bootstrap 95% CI", "Wilcoxon p", "win rate", "verdict"]
    rows = []
    for variant in [baseline] + sorted(set(runs.loc[runs["scale"] == scale, "variant"]) - {baseline}):
        values = at_scale.loc[at_scale["variant"] == variant, metric]
        cells = [variant, str(len(values)), _mean_sd(values)]
        if loss_like:
            cells.append(_num(math.exp(values.mean()), 2) if len(values) else "—")
        r = by_variant.get(variant)
        if r is None:
            cells += ["—"] * 6
        else:
            cells += [_signed(r.mean_delta), _ci(r.ci_low, r.ci_high), _ci(r.boot_ci_low, r.boot_ci_high),
                      _p(r.p_wilcoxon), _pct(r.win_rate), _verdict(r)]
        rows.append(cells)
    counted = runs.loc[runs["scale"] == scale, "params_counted"].median()
    size = f" (≈{counted / 1e6:,.1f}M counted parameters)" if pd.notna(counted) else ""
    return [Heading(f"Scale {scale}{size}", 3), Table(header, rows)]


def _deltas_table(results: list[PairedResult]) -> Table:
    header = ["scale", "variant", "n", "Δ mean ± sd", "t 95% CI", "bootstrap 95% CI", "method", "Wilcoxon p",
              "win rate", "verdict"]
    rows = [[r.scale, r.variant, str(r.n), f"{_signed(r.mean_delta)} ± {_num(r.sd_delta)}",
             _ci(r.ci_low, r.ci_high), _ci(r.boot_ci_low, r.boot_ci_high), r.boot_method, _p(r.p_wilcoxon),
             _pct(r.win_rate), _verdict(r)] for r in results]
    return Table(header, rows)


def _joint_table(joint: list[JointResult]) -> Table:
    rows = [[_task_label(j.metrics), j.scale, j.variant, str(j.n), _signed(j.mean_delta),
             _ci(j.boot_ci_low, j.boot_ci_high), j.boot_method] for j in joint]
    header = ["metrics", "scale", "variant", "n", "mean Δ across tasks", "joint bootstrap 95% CI", "method"]
    return Table(header, rows)


def _scaling_table(scaling: ScalingReport) -> Table:
    rows = []
    for variant, fit in scaling.fits.items():
        cross = scaling.crossings.get(variant)
        rows.append([
            variant, fit.form, fit.status, f"{fit.n_points} / {fit.n_scales}",
            f"{_num(fit.E, 3)} ± {_num(fit.E_sd, 3)}", _num(fit.A, 4, general=True),
            f"{_num(fit.alpha, 3)} ± {_num(fit.alpha_sd, 3)}", _ci(fit.alpha_boot[0], fit.alpha_boot[1], 3),
            "—" if variant == scaling.baseline or cross is None
            else (", ".join(f"{n:.3g}" for n in cross) or "none in range"),
        ])
    header = ["variant", "form", "status", "runs / scales", "E ± se", "A", "α ± se", "α seed-bootstrap CI",
              f"crosses {scaling.baseline} at N"]
    return Table(header, rows)


def _missing(runs: pd.DataFrame, unpaired: list[dict], metrics: list[str]) -> list[Block]:
    blocks: list[Block] = [Heading("Unfinished and unpaired runs")]
    unfinished = runs[runs["status"] != store.FINISHED]
    if len(unfinished):
        blocks.append(Table(["run", "status", "run key"], [[r.run_name, r.status, str(r.run_key)]
                                                           for r in unfinished.itertuples()]))
    if unpaired:
        blocks.append(Table(["variant", "scale", "seed", "status", "run key", "reason", "metrics"],
                            [[u["variant"], u["scale"], str(u["seed"]), u["status"], str(u["run_key"]), u["reason"],
                              "all" if u["metrics"] == metrics else ", ".join(u["metrics"])] for u in unpaired]))
    if len(blocks) == 1:
        blocks.append(Paragraph("None: every run finished and every seed has its baseline partner."))
    return blocks


def _unpaired(results: list[PairedResult]) -> list[dict]:
    """Each unpaired run once per reason, with the metrics it is missing from."""
    merged: dict[tuple, dict] = {}
    for r in results:
        for u in r.unpaired:
            entry = merged.setdefault((u.run_id, u.variant, u.scale, u.seed, u.reason), {**vars(u), "metrics": []})
            if r.metric not in entry["metrics"]:
                entry["metrics"].append(r.metric)
    return list(merged.values())


def _csv_row(r: PairedResult) -> dict:
    row = {k: v for k, v in vars(r).items() if k not in ("seeds", "deltas", "unpaired")}
    row["seeds"] = ";".join(map(str, r.seeds))
    row["deltas"] = ";".join(f"{d:.6g}" for d in r.deltas)
    row["unpaired"] = len(r.unpaired)
    return row


def _log_report_run(uri: str, experiment: str, baseline: str, files: list[Path]) -> str:
    """Upload the files to the experiment's single report run, creating it the first time."""
    mlflow_client = store.client(uri)
    exp_id = store.experiment_id(mlflow_client, experiment)
    found = mlflow_client.search_runs([exp_id], filter_string=f"tags.`study.stage` = '{store.REPORT_STAGE}'",
                                      order_by=["attributes.start_time ASC"], max_results=1)
    if found:
        run_id = found[0].info.run_id
    else:
        tags = {"study.stage": store.REPORT_STAGE, "study.experiment": experiment}
        run_id = mlflow_client.create_run(exp_id, run_name=REPORT_RUN_NAME, tags=tags).info.run_id
    mlflow_client.set_tag(run_id, "study.baseline", baseline)
    for path in files:
        mlflow_client.log_artifact(run_id, str(path))
    mlflow_client.set_terminated(run_id, "FINISHED")
    return run_id


def _verdict(r: PairedResult) -> str:
    if r.n < 2 or math.isnan(r.ci_low):
        return "too few pairs"
    if r.ci_low > 0 or r.ci_high < 0:
        return "better" if (r.ci_low > 0) == r.higher_is_better else "worse"
    return "unclear"


def _without_credentials(uri: str) -> str:
    """The tracking URI as it may appear in a shared report: any ``user:password@`` dropped."""
    scheme, sep, rest = uri.partition("://")
    return f"{scheme}{sep}{rest.split('@', 1)[-1]}" if sep and "@" in rest.split("/", 1)[0] else uri


def _task_label(metrics: Sequence[str]) -> str:
    """``acc over arc_easy, piqa`` for ``eval/arc_easy/acc`` and ``eval/piqa/acc``."""
    parts = [m.split("/") for m in metrics]
    return f"{parts[0][2]} over {', '.join(p[1] for p in parts)}"


def _slug(metric: str) -> str:
    return metric.replace("/", "_")


def _num(x: float, digits: int = 4, general: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.{digits}g}" if general else f"{x:.{digits}f}"


def _signed(x: float) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:+.4f}"


def _ci(low: float, high: float, digits: int = 4) -> str:
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return "—"
    return f"[{low:+.{digits}f}, {high:+.{digits}f}]"


def _p(p: float) -> str:
    return "—" if p is None or not math.isfinite(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def _pct(x: float) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.0%}"


def _mean_sd(values: pd.Series) -> str:
    if not len(values):
        return "—"
    sd = values.std(ddof=1) if len(values) > 1 else math.nan
    return f"{values.mean():.4f} ± {_num(sd)}"


_METHOD = (
    "Runs are paired by (scale, seed): paired runs share data order and initialisation, so the per-seed "
    "difference cancels most seed noise. Only FINISHED runs with a final value pair; the rest are listed above. "
    "t CI: mean ± t(0.975, n−1)·sd/√n. Bootstrap CI: scipy.stats.bootstrap of the mean over seeds "
    "({n_resamples} resamples, fixed seed), BCa when n ≥ 3 and the deltas differ, percentile otherwise; with "
    "few seeds it is narrower than the t interval and should be read as descriptive. Wilcoxon: two-sided "
    "signed-rank test of the deltas (exact for small n; with 5 pairs the smallest possible p is 0.0625). Win "
    "rate: share of seeds where the variant is strictly better (lower loss/perplexity, higher accuracy). "
    "PPL = exp(mean final val loss). Scaling: L(N) = E + A·N^(−α) fitted by least squares on every finished run "
    "(N = counted parameters), covariance standard errors and a seed bootstrap for α; a pure power law with "
    "fewer than 4 scales. Crossings compare point-estimate fits; beyond the largest scale they are extrapolations."
)
