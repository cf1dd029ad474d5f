"""From a reference run's work profile to a geometry-scheduled model that meets the scale's parameter budget."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from study.budget import Matched, match, target_width
from study.config import RunConfig
from study.errors import StudyError
from study.geometry.allocate import AllocationConfig, allocate_from_profile


def read_profile(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise StudyError("profile", f"cannot read the profile {path} ({err})",
                         "point at the profile.json that `study profile RUN_KEY` wrote") from None


def geometry_widths(profile: dict, uniform_width: float, n_layers: int, alloc: AllocationConfig) -> list[float]:
    """Real-valued per-layer widths with the total of `n_layers` uniform layers (the matcher rounds them)."""
    if int(profile["layers"]) != n_layers:
        raise StudyError("profile", f"the profile has {profile['layers']} layers, the model {n_layers}",
                         "profile a reference run with the same depth as the scheduled runs")
    return allocate_from_profile(profile, uniform_width, alloc)


def scheduled_model(cfg: RunConfig, path: Path, budget: int) -> Matched:
    """The run's model with geometry-allocated widths, matched to `budget` exactly."""
    profile = read_profile(path)
    ffn = cfg.model.ffn
    widths = geometry_widths(profile, target_width(cfg.model) * ffn.k, cfg.model.n_layers, cfg.geometry)
    model = replace(cfg.model, ffn=replace(ffn, widths=widths))
    return match(model, budget, cfg.budget)
