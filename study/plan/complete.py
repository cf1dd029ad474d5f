"""Completing a geometry-scheduled run's spec: widths from its reference's work profile, matched to the budget, in
the job that consumes the profile (the spec is written back to the run directory) and in `study plan` alike.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from study.config.run import RunConfig
from study.config.spec import RunSpec
from study.errors import StudyError
from study.geometry.allocate import geometry_widths, read_profile
from study.plan.budget import Matched, flops_per_token, match, target_width, with_widths


def allocated(cfg: RunConfig, profile: dict, budget: int) -> tuple[list[float], Matched]:
    """The real-valued widths the config's allocation takes from a work profile (reflected for `reverse`), and the
    model with them matched to `budget` (the scheduled run's job and `study allocate` alike)."""
    widths = geometry_widths(profile, target_width(cfg.model) * cfg.model.ffn.k, cfg.model.n_layers, cfg.geometry,
                             reverse=cfg.model.ffn.schedule.reverse)
    return widths, match(with_widths(cfg.model, widths), budget, cfg.budget)


def complete_spec(spec: RunSpec) -> RunSpec:
    """The spec with geometry-allocated widths matched to its budget; a resolved spec is returned as it is."""
    if spec.pending is None:
        return spec
    path = Path(spec.profile) if spec.profile else None
    if path is None or not path.is_file():
        raise StudyError("profile", f"the geometry-scheduled run {spec.name} ({spec.key}) has no reference profile"
                         + (f" at {path}" if path else ""),
                         "train the reference run and run `study profile RUN_KEY` first (study launch chains them)")
    cfg = spec.config
    try:
        _, matched = allocated(cfg, read_profile(path, cfg.model.n_layers), spec.budget)
    except StudyError as err:
        raise StudyError(err.field, f"{err.problem} (variant {cfg.variant}, scale {cfg.scale})", err.fix) from None
    return replace(spec, config=replace(cfg, model=matched.model), params=asdict(matched.params),
                   mismatch=matched.mismatch, flops_per_token=flops_per_token(matched.model, cfg.data.seq_len),
                   pending=None)
