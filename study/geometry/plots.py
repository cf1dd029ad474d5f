"""Figures of the geometry stage: the work profile over depth and the widths it leads to (PNG, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from study.config.geometry import STATISTICS
from study.config.geometry import GEOMETRIES

_TITLES = {"shift": "shift", "gw": "metric distortion (GW)", "topo": "topological change (H1 W2)"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_profile(profile: dict, path: str | Path) -> Path:
    """Work vs depth for the 9 statistic x geometry combinations, one panel per statistic.

    Each curve is divided by its own mean: raw work is in the states' units and normalised work in radians, so only
    the shapes are comparable, and the shape (front-loaded or back-loaded) is what the allocation follows.
    """
    plt = _pyplot()
    layers = np.arange(profile["layers"])
    fig, axes = plt.subplots(1, len(STATISTICS), figsize=(4.2 * len(STATISTICS), 3.4), sharey=True)
    for ax, statistic in zip(axes, STATISTICS):
        for geometry in GEOMETRIES:
            work = np.asarray(profile["stats"][statistic][geometry], dtype=np.float64)
            mean = work.mean()
            ax.plot(layers, work / mean if mean > 0 else work, marker="o", ms=3, label=geometry)
        ax.set_title(_TITLES[statistic])
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("work / mean over layers")
    axes[-1].legend(title="geometry")
    fig.suptitle(f"FFN work profile ({profile['n_tokens']} tokens)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_widths(widths_by_schedule: dict[str, list], path: str | Path) -> Path:
    """FFN width per layer for each schedule (e.g. uniform, cosine taper, geometry-derived, anti)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for name, widths in widths_by_schedule.items():
        ax.plot(np.arange(len(widths)), widths, marker="o", ms=3, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("FFN width")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
