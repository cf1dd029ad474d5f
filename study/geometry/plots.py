"""Figures of the geometry profile: the work profile over depth and the widths it leads to (PNG, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from study.config.geometry import GEOMETRIES, STATISTICS

_TITLES = {"shift": "shift", "gw": "metric distortion (GW)", "topo": "topological change (H1 W2)"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_profile(profile: dict, path: str | Path) -> Path:
    """Work vs depth for the 9 statistic x geometry combinations, one panel per statistic."""
    return plot_reference_profiles({"": profile}, list(STATISTICS), path, row_height=3.4,
                                   title=f"FFN work profile ({profile['n_tokens']} tokens)")


def plot_reference_profiles(profiles: dict[str, dict], statistics: list[str], path: str | Path,
                            row_height: float = 3.0, title: str | None = None) -> Path:
    """One figure for a report: a row per reference profile (keyed by its scale), a panel per statistic, each
    showing the statistic's work per layer in each geometry, each curve divided by its own mean (the geometries'
    units differ; the shape is what the allocation follows)."""
    plt = _pyplot()
    size = (4.2 * len(statistics), row_height * len(profiles))
    fig, axes = plt.subplots(len(profiles), len(statistics), figsize=size, squeeze=False, sharey=True)
    for row, (scale, profile) in zip(axes, profiles.items()):
        for ax, statistic in zip(row, statistics):
            layers = np.arange(profile["layers"])
            for geometry in GEOMETRIES:
                work = np.asarray(profile["stats"][statistic][geometry], dtype=np.float64)
                mean = work.mean()
                ax.plot(layers, work / mean if mean > 0 else work, marker="o", ms=3, label=geometry)
            ax.set_xlabel("layer")
            ax.grid(alpha=0.3)
            ax.set_title(f"{scale}: {_TITLES[statistic]}" if scale else _TITLES[statistic])
        row[0].set_ylabel("work / mean over layers")
    axes[0][-1].legend(title="geometry")
    if title:
        fig.suptitle(title)
    return _save(fig, plt, path)


def plot_widths(widths_by_schedule: dict[str, list], path: str | Path) -> Path:
    """FFN width per layer for each schedule (e.g. uniform, cosine taper, geometry-derived, reversed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for name, widths in widths_by_schedule.items():
        ax.plot(np.arange(len(widths)), widths, marker="o", ms=3, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("FFN width")
    # from 0: the autoscaled axis would stretch widths a unit apart (rounding) over the whole panel, like a taper
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)
