"""The report's figures: loss curves with seed bands, the decisions as forest plots, the scaling fits, the decay
branches' fits (iso-FLOP curves of L(N, D), or loss against tokens), the LR grids of the tuning. Figures are
built as ``matplotlib.figure.Figure`` and written by the Agg canvas, never pyplot: a caller's backend is left alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from analysis.decide import CORRECTION, VERDICT_COLORS, Decision
from analysis.paired import PairedResult
from analysis.run_table import FINISHED, scale_order
from analysis.scaling import ScalingReport
from analysis.surface import SurfaceReport
from analysis.tuning import TuneCurve

DPI = 110
"""Resolution of the PNGs; they are embedded in the HTML, so size matters."""


def variant_colors(variants: Sequence[str], baseline: str) -> dict[str, str]:
    """A stable colour per variant, the baseline always first (black)."""
    others = [v for v in sorted(variants) if v != baseline]
    return {baseline: "black", **{v: f"C{i % 10}" for i, v in enumerate(others)}}


def plot_loss_curves(
    runs: pd.DataFrame, curves: pd.DataFrame, baseline: str, path: Path, metric: str = "val/loss"
) -> Path:
    """One panel per scale: mean over finished seeds of ``metric`` against step per variant, shaded mean +- sd."""
    finished = runs[runs["status"] == FINISHED][["run_id", "variant", "scale", "seed"]]
    data = curves.merge(finished, on="run_id")
    scales = [s for s in scale_order(runs) if s in set(data["scale"])]
    colors = variant_colors(runs["variant"].unique(), baseline)
    fig, axes = _panels(len(scales), min(len(scales), 3) or 1, (4.2, 3.2))
    for ax, scale in zip(axes, scales):
        stats = (data[data["scale"] == scale].groupby(["variant", "step"])["value"]
                 .agg(["mean", "std", "count"]).reset_index())
        for variant, g in stats.groupby("variant"):
            sd = g["std"].fillna(0.0)
            ax.plot(g["step"], g["mean"], color=colors[variant], lw=1.4,
                    label=f"{variant} (n={int(g['count'].max())})")
            ax.fill_between(g["step"], g["mean"] - sd, g["mean"] + sd, color=colors[variant], alpha=0.2, lw=0)
        # Early steps sit far above the end of training; zoom on the last 90% so the gaps between variants show.
        late = stats[stats["step"] >= 0.1 * stats["step"].max()]
        if len(late):
            low, high = (late["mean"] - late["std"].fillna(0)).min(), late["mean"].max()
            pad = 0.05 * (high - low) or 0.01
            ax.set_ylim(low - pad, high + pad)
        ax.set_title(f"scale {scale}")
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{metric} over training (mean ± sd over seeds)")
    return _save(fig, path)


def plot_decisions(decisions: Sequence[Decision], path: Path) -> Path:
    """The decision table as a forest, one panel per metric: per (scale, variant) its mean Δ and the adjusted t
    interval its verdict agrees with, coloured by verdict, the equivalence margin shaded."""
    from matplotlib.lines import Line2D

    metrics = list(dict.fromkeys(d.metric for d in decisions))
    rows = max(sum(d.metric == m for d in decisions) for m in metrics)
    cols = min(len(metrics), 3)
    # wide enough for the labels, no wider than the 1,280-pixel window the report is read in
    width = 9.0 if cols == 1 else min(4.0 * cols + 1.5, 11.5)
    fig, axes = _panels(len(metrics), cols, (width / cols, 0.24 * rows + 1.0), pad=0.4)
    for ax, metric in zip(axes, metrics):
        _decision_panel(ax, [d for d in decisions if d.metric == metric])
    fig.legend([Line2D([], [], color=c, marker="o", lw=1.5) for c in VERDICT_COLORS.values()], list(VERDICT_COLORS),
               loc="outside lower center", ncols=len(VERDICT_COLORS), fontsize=8, frameon=False)
    return _save(fig, path)


def _decision_panel(ax, decisions: Sequence[Decision]) -> None:
    shown = list(reversed(decisions))
    for y, d in enumerate(shown):
        color = VERDICT_COLORS[d.verdict]
        if math.isfinite(d.adj_ci_low):
            ax.hlines(y, d.adj_ci_low, d.adj_ci_high, color=color, lw=1.8)
        if math.isfinite(d.mean_delta):
            ax.plot(d.mean_delta, y, "o", color=color, ms=5)
    margin = decisions[0].margin
    if margin:
        ax.axvspan(-margin, margin, color="#0969da", alpha=0.1, lw=0)
    ax.axvline(0.0, color="grey", lw=0.8, ls="--")
    for y in range(1, len(shown)):  # a rule between scales
        if shown[y].scale != shown[y - 1].scale:
            ax.axhline(y - 0.5, color="#bbb", lw=0.6)
    ax.set_yticks(range(len(shown)), [f"{d.variant} @ {d.scale}" for d in shown], fontsize=8)
    ax.set_ylim(-0.7, max(len(shown), 1) - 0.3)
    d = decisions[0]
    better = "right" if d.higher_is_better else "left"
    ax.set_xlabel(f"Δ vs {d.baseline}; better to the {better}", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{d.metric}: mean Δ, {CORRECTION[d.family]}-adjusted t CI"
                 + (f", margin ±{margin:g} shaded" if margin else ""), fontsize=9)


def plot_scaling(runs: pd.DataFrame, report: ScalingReport, path: Path,
                 deltas: Sequence[PairedResult] = ()) -> Path:
    """Left: final metric against counted parameters per variant, with fits (dashed past the data). Right: each
    fit minus the baseline's, with the paired deltas (mean and t interval) on top at each scale's median N."""
    metric = report.metric
    used = runs[(runs["status"] == FINISHED) & runs[metric].notna() & runs["params_counted"].notna()]
    colors = variant_colors(runs["variant"].unique(), report.baseline)
    fig, (ax, gap_ax) = _panels(2, 2, (5.5, 4.3))
    top = report.n_range[1]
    for variant, g in used.groupby("variant"):
        color = colors[variant]
        ax.scatter(g["params_counted"], g[metric], s=10, color=color, alpha=0.35, lw=0)
        means = g.groupby("scale")[["params_counted", metric]].mean()
        fit = report.fits.get(variant)
        label = variant if fit is None or fit.form == "none" else f"{variant}: {fit.form}, α={fit.alpha:.3f}"
        ax.plot(means["params_counted"], means[metric], "o", color=color, ms=5, label=label)
        if fit is not None and fit.form != "none":
            _fitted(ax, fit.n_min, fit.n_max, top, fit.predict, color)
    base = report.fits.get(report.baseline)
    sizes = used.groupby("scale")["params_counted"].median()
    for variant, fit in report.fits.items():
        if variant == report.baseline or base is None or "none" in (fit.form, base.form):
            continue
        lo, hi = max(fit.n_min, base.n_min), min(fit.n_max, base.n_max)
        _fitted(gap_ax, lo, hi, top, lambda n, f=fit: f.predict(n) - base.predict(n), colors[variant], variant)
        cross = report.crossings.get(variant)
        for n in (cross.sizes if cross else []):
            for a in (ax, gap_ax):
                a.axvline(n, color=colors[variant], lw=0.8, ls=":")
            gap_ax.annotate(f"N≈{n:.3g}", (n, 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                            rotation=90, ha="right", va="bottom")
    others = sorted({r.variant for r in deltas})
    for r in deltas:
        if r.n > 0 and r.scale in sizes.index:
            half = (r.ci_high - r.ci_low) / 2 if math.isfinite(r.ci_low) else 0.0
            # Nudge variants apart along N so intervals at one scale do not hide each other.
            dodge = 1.04 ** (others.index(r.variant) - (len(others) - 1) / 2)
            gap_ax.errorbar(sizes[r.scale] * dodge, r.mean_delta, yerr=half, fmt="o", ms=4, capsize=3,
                            color=colors.get(r.variant, "grey"))
    gap_ax.axhline(0.0, color="black", lw=0.8)
    _log_panel(ax, "counted parameters N", f"final {metric}", f"Final {metric} with fits (dashed: extrapolation)")
    _log_panel(gap_ax, "counted parameters N", f"Δ {metric} vs {report.baseline}",
               "Fit minus baseline fit; points: paired deltas with t 95% CI",
               legend=bool(gap_ax.get_legend_handles_labels()[0]))
    return _save(fig, path)


def plot_isoflops(report: SurfaceReport, path: Path) -> Path:
    """One panel per arm: its fitted loss along each scale's iso-FLOP line against N, optimum ●, planned run ×."""
    from matplotlib import colormaps

    variants = list(dict.fromkeys(i.variant for i in report.isoflops))
    optima = {(o.variant, o.scale): o for o in report.optima}
    fig, axes = _panels(len(variants), min(len(variants), 3), (4.4, 3.4), sharey=True)
    for ax, variant in zip(axes, variants):
        lines = [i for i in report.isoflops if i.variant == variant]
        # light to dark, as the lines are ordered by compute
        for line, color in zip(lines, colormaps["viridis"](np.linspace(0.85, 0.1, len(lines)))):
            o = optima[variant, line.scale]
            ax.plot(line.n, line.loss, color=color, lw=1.3, label=f"{line.scale}: C = {line.compute:.2g} FLOPs")
            if math.isfinite(o.n_opt):
                ax.plot(o.n_opt, o.loss_opt, "o", color=color, ms=5)
            ax.plot(o.planned_n, o.planned_loss, "x", color=color, ms=6, mew=1.5)
        _log_panel(ax, "counted parameters N", f"fitted final {report.metric}",
                   f"{variant}: iso-FLOP lines (● optimum, × planned)")
    return _save(fig, path)


def plot_loss_tokens(report: SurfaceReport, path: Path) -> Path:
    """One panel per scale: every branch end's final metric against its tokens per arm, with the arm's fitted L(D)."""
    points = report.points
    scales = list(dict.fromkeys(f.scale for f in report.fits))
    colors = variant_colors(points["variant"].unique(), report.baseline)
    fig, axes = _panels(len(scales), len(scales), (4.6, 3.6))
    for ax, scale in zip(axes, scales):
        for fit in (f for f in report.fits if f.scale == scale):
            mine = points[(points["variant"] == fit.variant) & (points["scale"] == scale)]
            color = colors[fit.variant]
            ax.scatter(mine["d"], mine[report.metric], s=14, color=color, alpha=0.6, lw=0)
            label = fit.variant
            if fit.form != "none":
                tokens = np.geomspace(*fit.d_range, 100)
                ax.plot(tokens, fit.predict(math.nan, tokens), color=color, lw=1.2)
                label += f": E={fit.E:.3f}, β={fit.beta:.3f}"
            ax.plot([], [], "o-", color=color, ms=4, lw=1.2, label=label)
        _log_panel(ax, "training tokens D", f"final {report.metric}", f"Branch ends at {scale} with fitted L(D)")
    return _save(fig, path)


def plot_tuning(curves: Sequence[TuneCurve], baseline: str, path: Path, metric: str = "val/loss") -> Path:
    """One panel per tune scale: final ``metric`` against peak LR per variant, means joined, the chosen LR dashed."""
    scales = list(dict.fromkeys(c.scale for c in curves))
    colors = variant_colors({c.variant for c in curves} | {baseline}, baseline)
    fig, axes = _panels(len(scales), len(scales), (5.2, 3.8))
    for ax, scale in zip(axes, scales):
        for c in (c for c in curves if c.scale == scale):
            color = colors[c.variant]
            ax.scatter([p["lr"] for p in c.points], [p["loss"] for p in c.points], s=14, color=color, alpha=0.5,
                       lw=0)
            label = c.variant
            if math.isfinite(c.chosen_lr):
                ax.axvline(c.chosen_lr, color=color, lw=1.0, ls="--")
                label += f": chosen ×{c.chosen_multiple:.3g} ({c.status or 'status not recorded'})"
            lrs = [np.median([p["lr"] for p in c.points if p["multiple"] == m]) for m in c.multiples]
            ax.plot(lrs, c.mean_losses, "-o", color=color, ms=4, lw=1.2, label=label)
        _log_panel(ax, "peak LR", f"final {metric}",
                   f"LR grid at {scale}: seeds (dots), mean (line), chosen LR (dashed)")
    return _save(fig, path)


def _panels(count: int, cols: int, size: tuple[float, float], pad: float = 0.0, **options):
    """A figure of ``count`` panels of ``size`` inches, ``cols`` to a row, ``pad`` inches more below them, and its axes
    (the spare ones hidden)."""
    from matplotlib.figure import Figure

    rows = max(1, math.ceil(count / cols))
    fig = Figure(figsize=(size[0] * cols, size[1] * rows + pad), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **options).ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes


def _log_panel(ax, xlabel: str, ylabel: str, title: str, legend: bool = True) -> None:
    """A panel's log x axis, labels, small title, grid and (unless told not to) legend."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if legend:
        ax.legend(fontsize=7)


def _fitted(ax, lo: float, hi: float, top: float, curve, color: str, label: str | None = None) -> None:
    """A fitted curve: solid over the observed sizes, dashed from there up to ``top``."""
    inside = np.geomspace(lo, hi, 100)
    ax.plot(inside, curve(inside), color=color, lw=1.2, label=label)
    if np.isfinite(top) and top > hi:
        beyond = np.geomspace(hi, top, 100)
        ax.plot(beyond, curve(beyond), color=color, lw=1.0, ls="--")


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
