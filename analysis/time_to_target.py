"""Time to target: the GPU-hours each arm needed to reach the final val/loss of the baseline run of its seed (along
its validation curve, at its measured throughput), and the throughput-adjusted verdict on their log ratio, decided as
the primary family is. A run that never reaches the target counts its whole training, a lower bound that can make a
variant *worse*, never *better*. analysis/README.md ("Time to target") has the rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis import run_table
from analysis.decide import decide
from analysis.paired import paired_deltas
from analysis.records import JsonRecord, read_artifact
from study.config.decision import DecisionRule
from study.errors import StudyError
from study.track.query import open_store

LOG_HOURS = "time/log_gpu_hours"
"""Column of ln(GPU-hours to the target), the quantity the throughput-adjusted verdict pairs."""

THROUGHPUT = "train/tokens_per_s"
"""The metric a training run logs its whole job's tokens per second under."""

SPEC_ARTIFACT = "run.json"
"""The artifact a training run logs its spec under (study.train.tracking)."""


@dataclass(frozen=True)
class Throughput:
    """Where one run's speed comes from."""

    tokens_per_s_per_device: float
    """Training tokens per second per device."""
    devices: int | None
    """Devices of the run's job, from its spec; None when the spec could not be read (one is counted)."""
    source: str
    """``measured on <cluster>`` (study calibrate) or ``own train/tokens_per_s``."""


@dataclass(frozen=True)
class TimeToTarget(JsonRecord):
    """GPU-hours to the baseline's final loss at one scale: the variant against the baseline, over seed pairs."""

    scale: str
    variant: str
    baseline: str
    """Variant whose final loss is the target."""
    n: int
    """Seed pairs with both curves and both throughputs."""
    target: float
    """Mean over the pairs of the baseline's final loss."""
    baseline_hours: float
    """Mean GPU-hours the baseline runs took to reach their own final loss."""
    variant_hours: float
    """Mean GPU-hours the variant runs took to reach it (a lower bound where some never did)."""
    reached: int
    """Pairs in which the variant reached the target."""
    ratio: float
    """Geometric mean over pairs of variant / baseline GPU-hours (< 1: sooner); a lower bound when reached < n."""
    ci_low: float
    """ci_low and ci_high: the paired t interval of the ratio (at 1 - alpha, from the log ratios)."""
    ci_high: float
    p_adjusted: float
    """Holm-adjusted paired t p of the log ratio over the scale x variant family."""
    verdict: str
    """better (fewer GPU-hours), worse or undecided; never better when some seed did not reach the target."""
    throughput: str
    """Where the speeds of these runs came from."""


@dataclass(frozen=True)
class TimeReport(JsonRecord):
    """Time to target for every variant and scale, and what its hours rest on."""

    baseline: str
    """Variant whose final loss is the target."""
    rows: list[TimeToTarget] = field(default_factory=list)
    """One per (scale, variant other than the baseline)."""
    devices_unknown: list[str] = field(default_factory=list)
    """Runs whose spec could not be read, counted as one device each."""


def time_to_target(runs: pd.DataFrame, curves: pd.DataFrame, baseline: str, rule: DecisionRule, uri: str,
                   metric: str = "val/loss") -> TimeReport:
    """GPU-hours to the baseline's final ``metric`` per run, paired per seed and decided per (scale, variant);
    ``curves`` are the finished runs' histories (:func:`analysis.run_table.read_curves`, a branch's from step 0)."""
    # the run each pair uses, as analysis.paired chooses it: the newest finished one with a final metric
    usable = runs[(runs["status"] == run_table.FINISHED) & np.isfinite(runs[metric].to_numpy(float))]
    chosen = (usable.sort_values("start_time").drop_duplicates(["variant", "scale", "seed"], keep="last")
              .reset_index(drop=True))
    speed = throughputs(chosen, uri)
    by_run = dict(tuple(curves.groupby("run_id")))
    # each run's target: the final metric of the baseline run of its scale and seed (NaN without one)
    target = chosen[chosen["variant"] == baseline].set_index(["scale", "seed"])[metric]
    hours = [_hours(run, by_run.get(run.run_id), speed.get(run.run_id), target.get((run.scale, run.seed), math.nan))
             for run in chosen.itertuples()]
    frame = chosen.assign(hours=[h for h, _ in hours], total=[t for _, t in hours])
    # a run that never reached the target took longer than its whole training: that is its lower bound
    frame[LOG_HOURS] = np.log(frame["hours"].where(np.isfinite(frame["hours"]), frame["total"]))
    results = paired_deltas(frame, LOG_HOURS, baseline, higher_is_better=False, n_resamples=0)
    own_rule = DecisionRule(metric=LOG_HOURS, alpha=rule.alpha, power=rule.power)
    rows = []
    for r, d in zip(results, decide({LOG_HOURS: results}, own_rule)):
        if not r.n:
            continue
        cell = frame[frame["scale"] == r.scale].set_index(["variant", "seed"])
        mine, base = cell.loc[r.variant].loc[r.seeds], cell.loc[baseline].loc[r.seeds]
        reached = int(np.isfinite(mine["hours"]).sum())
        # a lower bound can show the variant slower, never faster
        verdict = "undecided" if reached < r.n and d.verdict == "better" else d.verdict
        rows.append(TimeToTarget(
            r.scale, r.variant, baseline, r.n, float(base[metric].mean()), float(base["hours"].mean()),
            float(np.exp(mine[LOG_HOURS]).mean()), reached, math.exp(d.mean_delta), math.exp(d.ci_low),
            math.exp(d.ci_high), d.p_adjusted, verdict,
            ", ".join(sorted({speed[i].source for i in [*mine["run_id"], *base["run_id"]]}))))
    unknown = sorted(str(r.run_name) for r in chosen.itertuples() if r.run_id in speed
                     and speed[r.run_id].devices is None)
    return TimeReport(baseline, rows, unknown)


def throughputs(runs: pd.DataFrame, uri: str) -> dict[str, Throughput]:
    """Tokens per second per device of each run: its shape's calibration, else its own median figure."""
    from study.plan.throughput import devices, estimate, measured

    client = open_store(uri, required=True)
    # the runs of a cell share a shape and a cluster profile: one spec per cell says both
    specs = {cell: _spec(client, group["run_id"].iloc[0]) for cell, group in runs.groupby(["variant", "scale"])}
    calibrations = measured(uri) if any(s is not None for s in specs.values()) else {}
    out: dict[str, Throughput] = {}
    own = []
    for run in runs.itertuples():
        spec = specs[run.variant, run.scale]
        found = estimate(spec, calibrations) if spec is not None and spec.recipe is not None else None
        if found is not None and found.tokens_per_s is not None:
            n = devices(spec)
            out[run.run_id] = Throughput(found.tokens_per_s / n, n, found.source)
        else:
            own.append((run.run_id, devices(spec) if spec is not None else None))
    # a decay branch's own steps are a few after a restart: its trunk's figures count too (the same model)
    medians = (run_table.read_curves([rid for rid, _ in own], THROUGHPUT, uri, trunks=run_table.trunk_links(runs))
               .groupby("run_id")["value"].median())
    for run_id, n in own:
        if run_id in medians.index:
            out[run_id] = Throughput(float(medians[run_id]) / (n or 1), n, f"own {THROUGHPUT}")
    return out


def first_reach(steps: np.ndarray, values: np.ndarray, target: float) -> float:
    """The first step at which the curve is at or below ``target``, interpolated from the point before; inf if never."""
    below = np.flatnonzero(values <= target)
    if not len(below):
        return math.inf
    i = below[0]
    if i == 0:
        return float(steps[0])
    return float(np.interp(target, [values[i], values[i - 1]], [steps[i], steps[i - 1]]))


def _hours(run, curve: pd.DataFrame | None, speed: Throughput | None, target: float) -> tuple[float, float]:
    """(GPU-hours to reach ``target``, inf if never; GPU-hours to its last point); NaN where anything is unknown."""
    per_step = run.tokens / run.max_steps if run.tokens > 0 and run.max_steps > 0 else run.global_batch * run.seq_len
    if speed is None or not per_step > 0 or curve is None or not math.isfinite(target):
        return math.nan, math.nan
    steps = curve["step"].to_numpy(float)
    hours_per_step = per_step / speed.tokens_per_s_per_device / 3600
    return first_reach(steps, curve["value"].to_numpy(float), target) * hours_per_step, steps[-1] * hours_per_step


def _spec(client, run_id: str):
    """The run's spec (its ``run.json`` artifact); None when it logged none or another key schema wrote it."""
    from study.config.spec import read_spec

    try:
        return read_artifact(client, run_id, SPEC_ARTIFACT, read_spec)
    except StudyError:
        return None
