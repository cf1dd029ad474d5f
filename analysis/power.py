"""Power before spending: per comparison, the seeds that resolve the declared margin and the GPU-hours they cost.
The noise is the sd of paired deltas measured in the store (from :data:`MIN_PAIRS_FOR_SD` finished pairs), else the
experiment's ``decision.prior_sd``; resolving means finding a true difference of one margin (paired t) and showing a
true 0 equivalent (TOST), each with the rule's power at the family's Bonferroni level alpha/m.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from unittest.mock import patch

from analysis.sample_size import seeds_for_difference, seeds_for_equivalence
from study.config.decision import DecisionRule

MIN_PAIRS_FOR_SD = 3
"""Finished pairs of a comparison before its measured sd replaces the prior."""


@dataclass(frozen=True)
class PowerRow:
    """The seeds one (scale, variant) comparison needs."""

    scale: str
    variant: str
    """Variant compared with the baseline."""
    sd: float | None
    """sd of paired deltas used (None: neither measured nor a prior)."""
    source: str
    """Where the sd comes from: ``measured (n pairs)``, ``prior`` or ``none``."""
    seeds_difference: int | None
    """Pairs to find a true |delta| = margin."""
    seeds_equivalence: int | None
    """Pairs to show equivalence when the true delta is 0."""
    seeds_needed: int | None
    """The larger of the two: the pairs that resolve the comparison either way."""
    planned: int
    """Seeds the experiment file plans at this scale."""
    gpu_hours: float | None
    """GPU-hours of seeds_needed pairs (variant and baseline runs)."""
    hours_from_baseline: bool = False
    """The variant's widths wait for a profile, so its runs are costed at the baseline's (the budgets match)."""

    def to_dict(self) -> dict:
        return asdict(self)


def plan_power(plan, rule: DecisionRule, measured: dict[tuple[str, str], tuple[float, int]] | None = None
               ) -> list[PowerRow]:
    """One row per (scale, variant other than the baseline) of ``plan`` (a :class:`study.plan.planner.Plan`)."""
    exp = plan.experiment
    others = [v.name for v in exp.variants if v.name != exp.baseline]
    m = max(1, len(others) * len(exp.scales))
    alpha = rule.alpha / m
    hours = {(r.config.variant, r.config.scale): r.gpu_hours() for r in plan.runs}
    rows = []
    for scale in exp.scales:
        for variant in others:
            sd, source = None, "none"
            if measured and (scale, variant) in measured:
                sd, n = measured[scale, variant]
                source = f"measured ({n} pairs)"
            elif rule.prior_sd:
                sd, source = rule.prior_sd, "prior"
            diff = equiv = None
            if sd and rule.margin:
                diff = seeds_for_difference(rule.margin, sd, alpha, rule.power)
                equiv = seeds_for_equivalence(0.0, rule.margin, sd, alpha, rule.power)
            needed = max((x for x in (diff, equiv) if x is not None), default=None)
            base_hours, var_hours = hours.get((exp.baseline, scale)), hours.get((variant, scale))
            borrowed = var_hours is None and base_hours is not None
            var_hours = base_hours if borrowed else var_hours
            cost = needed * (var_hours + base_hours) if needed and None not in (var_hours, base_hours) else None
            rows.append(PowerRow(scale, variant, sd, source, diff, equiv, needed, len(exp.seeds[scale]), cost,
                                 borrowed))
    return rows


def measured_noise(experiment: str, baseline: str, rule: DecisionRule, tracking_uri: str
                   ) -> tuple[dict[tuple[str, str], tuple[float, int]], str]:
    """(scale, variant) -> (sd of paired deltas, pairs) for comparisons with enough finished pairs, and a note on
    what was read. Planning never waits on a store: a server is asked once with a short timeout, and a store that
    cannot be read gives {} and is named in the note."""
    from study.errors import StudyError
    from study.track.store import read_per_version, resolve_tracking_uri, sqlite_path

    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        return {}, f"no store at {db} yet"

    def read() -> list:
        from analysis.paired import paired_deltas  # pandas and MLflow: only where there is a store to read
        from analysis.run_table import read_runs

        try:
            runs = read_runs(experiment, uri)
        except StudyError as err:  # the experiment is not in this version of the store: an answer, kept
            return [[], err.problem]
        if rule.metric not in runs.columns or baseline not in set(runs["variant"]):
            return [[], f"no finished {baseline} runs with {rule.metric} in the store yet"]
        results = paired_deltas(runs, rule.metric, baseline, n_resamples=0)
        rows = [[r.scale, r.variant, r.sd_delta, r.n] for r in results
                if r.n >= MIN_PAIRS_FOR_SD and math.isfinite(r.sd_delta) and r.sd_delta > 0]
        return [rows, f"measured for {len(rows)} comparisons with at least {MIN_PAIRS_FOR_SD} finished pairs"]

    try:
        with patch.dict(os.environ, {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}):
            rows, note = read_per_version(uri, ["paired noise", experiment, baseline, rule.metric], read)
    except StudyError as err:
        return {}, err.problem
    except Exception as err:  # a server that is down must not stop planning; the note says so
        return {}, f"the store could not be read ({type(err).__name__})"
    return {(scale, variant): (sd, n) for scale, variant, sd, n in rows}, note


def plan_power_rows(plan, unread: str | None = None) -> tuple[list, str]:
    """Power rows of a plan (study.plan.planner.Plan) with a decision margin, and where the noise came from; `unread`
    says why the store is not read (its server did not answer), and the prior stands in."""
    exp = plan.experiment
    rule = exp.decision
    if rule.margin is None or not plan.runs:
        return [], "no decision.margin declared: no power analysis"
    if unread:
        return plan_power(plan, rule), f"{unread}: decision.prior_sd is used"
    measured, note = measured_noise(exp.name, exp.baseline, rule, plan.runs[0].config.tracking.uri)
    return plan_power(plan, rule, measured), note
