"""The report's "Reference work profile" section, for an experiment whose scheduled runs take their widths from a
profiled reference run (study 2): every geometry's curve of each statistic in use (each reference run's
`geometry/profile.json`), and per scheduled variant the curve it follows (its `geometry.*` params, reflected for the
anti control) and which way it points, so an arm that runs the same way as the arm it should oppose shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis import run_table
from analysis.records import read_artifact
from analysis.render import Block, Heading, Paragraph, Plot, Table
from study.config.geometry import GEOMETRIES, STATISTICS
from study.track.query import open_store
from study.config.run import Role
from study.geometry.allocate import reversed_profile
from study.geometry.direction import BALANCED, depth_centre, direction

PROFILE_ARTIFACT = "geometry/profile.json"
"""Where `study profile` logs a reference run's profile (study/jobs/profile.py)."""

FIGURE = "reference_profile.png"
"""The section's figure, beside report.md."""


REVERSE = "model.ffn.schedule.reverse"
OLD_REVERSE = "geometry.anti"
"""The param runs logged the reverse flag under before the schedule was a mapping: older stores still read."""


@dataclass(frozen=True)
class Arm:
    """One scheduled variant at one scale, as its newest run logged it."""

    scale: str
    variant: str
    statistic: str
    """The work statistic its widths follow."""
    geometry: str
    """The geometry that statistic is measured in."""
    reverse: bool
    """The anti control: widths reflected against the allocation."""
    widths: list[int] | None
    """The per-layer FFN widths it trained; None before the run logged them."""

    @property
    def curve(self) -> str:
        """`statistic / geometry`, marked when the widths are reflected against it."""
        return f"{self.statistic} / {self.geometry}" + (", reversed" if self.reverse else "")


@dataclass(frozen=True)
class ProfileSection:
    """The section's blocks, the files it wrote and what report.json records of it; empty without a reference."""

    blocks: list[Block]
    files: list[Path]
    summary: list[dict]


def reference_profile_section(runs: pd.DataFrame, uri: str, out: Path) -> ProfileSection:
    """The section for the training runs `runs`, its figure written to `out`; empty when no reference run trained."""
    if "role" not in runs.columns or not (runs["role"] == Role.reference).any():
        return ProfileSection([], [], [])
    client = open_store(uri, required=True)
    profiles = _reference_profiles(client, runs)
    arms = _arms(client, runs)
    blocks: list[Block] = [Heading("Reference work profile"), Paragraph(_INTRO)]
    missing = sorted(set(runs.loc[runs["role"] == Role.reference, "scale"]) - set(profiles), key=_scale_key(runs))
    if missing:
        blocks.append(Paragraph(f"No profile on the reference run of {', '.join(missing)} yet ({PROFILE_ARTIFACT} "
                                "is logged by `study profile RUN_KEY`, which `study launch` runs after the reference "
                                "trains)."))
    if not profiles:
        return ProfileSection(blocks, [], [])
    from study.geometry.plots import plot_reference_profiles

    statistics = [s for s in STATISTICS if any(a.statistic == s for a in arms)] or list(STATISTICS)
    path = plot_reference_profiles(profiles, statistics, out / FIGURE)
    blocks.append(Plot(path, "Work per layer of each reference run in each geometry, each curve divided by its mean "
                             "over layers (only the shape, the direction, compares)"))
    curves = [[scale, statistic, *(_described(profile["stats"][statistic][g]) for g in GEOMETRIES)]
              for scale, profile in profiles.items() for statistic in statistics]
    blocks.append(Table(["scale", "statistic", *GEOMETRIES], curves))
    summary = []
    rows = []
    for arm in arms:
        profile = profiles.get(arm.scale)
        if profile is None:
            continue
        work = profile["stats"][arm.statistic][arm.geometry]
        followed = reversed_profile(work) if arm.reverse else work
        trained = _described(arm.widths) if arm.widths else "not logged yet"
        rows.append([arm.scale, arm.variant, arm.curve, _described(followed), trained])
        summary.append({"scale": arm.scale, "variant": arm.variant, "statistic": arm.statistic,
                        "geometry": arm.geometry, "reverse": arm.reverse, "direction": direction(followed),
                        "centre": depth_centre(followed),
                        "widths_direction": direction(arm.widths) if arm.widths else None})
    if rows:
        blocks += [Paragraph("Each scheduled variant follows one curve; a reversed one (the anti control) has its "
                             "widths reflected against the allocation, so it points the other way."),
                   Table(["scale", "variant", "follows", "direction of the curve it follows", "trained widths"],
                         rows)]
    else:
        blocks.append(Paragraph("No scheduled run has logged its schedule yet."))
    return ProfileSection(blocks, [path], summary)


def _reference_profiles(client, runs: pd.DataFrame) -> dict[str, dict]:
    """scale -> the profile of that scale's newest reference run that has one, smallest scale first."""
    out: dict[str, dict] = {}
    refs = runs[runs["role"] == Role.reference].sort_values("start_time", ascending=False)
    for row in refs.itertuples():
        if row.scale not in out and (profile := read_artifact(client, row.run_id, PROFILE_ARTIFACT)) is not None:
            out[row.scale] = profile
    order = _scale_key(runs)
    return dict(sorted(out.items(), key=lambda item: order(item[0])))


def _arms(client, runs: pd.DataFrame) -> list[Arm]:
    """The newest run of each scheduled (scale, variant), read back from its params."""
    newest = (runs[runs["role"] == Role.scheduled].sort_values("start_time", ascending=False)
              .drop_duplicates(["scale", "variant"]))
    order = _scale_key(runs)
    arms = []
    for row in sorted(newest.itertuples(), key=lambda r: (order(r.scale), r.variant)):
        params = client.get_run(row.run_id).data.params
        widths = params.get("resolved.ffn_widths")
        arms.append(Arm(row.scale, row.variant, params["geometry.statistic"], params["geometry.geometry"],
                        params.get(REVERSE, params.get(OLD_REVERSE, "false")) == "true",
                        json.loads(widths) if widths not in (None, "null") else None))
    return arms


def _scale_key(runs: pd.DataFrame):
    order = run_table.scale_order(runs)
    return lambda scale: order.index(scale) if scale in order else len(order)


def _described(values) -> str:
    return f"{direction(values)} (centre at {depth_centre(values):.0%} of depth)"


_INTRO = (
    "The uniform reference run of each scale was profiled: the geometric work each FFN does on the token cloud, per "
    "layer, for each statistic and geometry (raw: Euclidean on the states; spherical and hyperbolic: on unit-"
    "normalised states). Raw work tends to track the residual norm and rise with depth while normalised work tends "
    "to be front-loaded, so the geometry an arm follows can set its direction. A curve's direction is where its "
    "work above its minimum sits along depth, its centre from 0% (first layer) to 100% (last): front-loaded "
    f"below 50%, back-loaded above, balanced within {BALANCED:.0%} of depth of the middle."
)
