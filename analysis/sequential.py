"""Seeds added only where a comparison is still undecided (``study launch --until-decided``): a group-sequential
procedure with Bonferroni alpha spending, each look deciding the primary family with Holm at its share of alpha, a
verdict once reached final. :func:`until_decided` trains through ``execute`` and reads through ``read`` (real
launches, or a noise model in tests); each look reads only the seeds planned up to it, so a rerun replays it.
analysis/README.md ("Power before spending and adaptive seeds") has the argument.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd

from analysis.decide import Decision, decide
from analysis.paired import paired_deltas
from analysis.records import latest_record
from study.config.decision import DecisionRule
from study.errors import StudyError
from study.schema import ROLE_SEQUENTIAL, TAG_ROLE

LOOKS_ARTIFACT = "looks.json"
"""Artifact of that run holding every look with its full decision rows."""

Run = tuple[str, str, int]
"""(variant, scale, seed)."""


@dataclass(frozen=True)
class Caps:
    """Where the adaptive loop stops even with comparisons undecided."""

    max_seeds: int
    """Most seed pairs any comparison gets (the last planned look)."""
    max_gpu_hours: float | None = None
    """Most GPU-hours of training in total, the first round included; None: no cap."""


@dataclass
class Outcome:
    """What the loop did."""

    looks: list[dict] = field(default_factory=list)
    """Every look, in order (round, alpha, alpha_spent, n, verdicts, added, decisions)."""
    stopped: str = ""
    """Why it stopped: every comparison decided, the seed cap, or the GPU-hour cap."""
    gpu_hours: float = 0.0
    """GPU-hours of every run trained (estimated from the plan)."""

    @property
    def final(self) -> dict[tuple[str, str], dict]:
        """Per (scale, variant): the decision row of the look that decided it, else of the last look."""
        return final_decisions(self.looks)


def look_alpha(alpha: float, n_now: int, n_before: int, max_seeds: int) -> float:
    """Alpha spent at a look with ``n_now`` pairs after one with ``n_before`` (linear spending)."""
    return alpha * (min(n_now, max_seeds) - n_before) / max_seeds


def until_decided(rule: DecisionRule, baseline: str, seeds: dict[str, list[int]], variants: Sequence[str],
                  execute: Callable[[list[Run]], None], read: Callable[[], pd.DataFrame], cost: Callable[[Run], float],
                  caps: Caps, record: Callable[[dict], None] = lambda look: None) -> Outcome:
    """Train the experiment's runs, then add a seed per round to every undecided (scale, variant) until decided.

    ``seeds``: the experiment's seeds per scale; ``execute`` trains runs and returns when they are done; ``read`` gives
    the store's runs (:func:`analysis.run_table.read_runs`); ``cost`` one run's GPU-hours; ``record`` gets each look.
    """
    n0 = min(len(s) for s in seeds.values())
    if caps.max_seeds < n0:
        raise StudyError("--max-seeds", f"is {caps.max_seeds}, below the experiment's {n0} seeds",
                         f"pass --max-seeds {n0} or more")
    first = [(v, scale, s) for scale, ss in seeds.items() for v in variants for s in ss]
    out = Outcome(gpu_hours=sum(cost(r) for r in first))
    if caps.max_gpu_hours is not None and out.gpu_hours > caps.max_gpu_hours:
        raise StudyError("--max-gpu-hours", f"is {caps.max_gpu_hours:g}, below the first round's "
                         f"{out.gpu_hours:,.1f} GPU-hours", "raise it, or drop scales or seeds from the experiment")
    execute(first)
    seeds = {scale: list(ss) for scale, ss in seeds.items()}
    others = [v for v in variants if v != baseline]
    frozen: dict[tuple[str, str], Decision] = {}
    n_before, spent, n_now = 0, 0.0, n0
    for round_ in range(1, caps.max_seeds - n0 + 2):
        alpha = look_alpha(rule.alpha, n_now, n_before, caps.max_seeds)
        spent += alpha
        runs = _planned(read(), seeds)
        decisions = decide({rule.metric: paired_deltas(runs, rule.metric, baseline, n_resamples=0)}, rule,
                           alpha=alpha) if rule.metric in runs.columns else []
        for d in decisions:
            if d.verdict != "undecided" and (d.scale, d.variant) not in frozen:
                frozen[d.scale, d.variant] = d
        current = {(d.scale, d.variant): frozen.get((d.scale, d.variant), d) for d in decisions}
        open_ = sorted(k for k in ((scale, v) for scale in seeds for v in others) if k not in frozen)
        added, stop = _next_round(open_, seeds, baseline, n_now, caps, out.gpu_hours, cost)
        look = {"round": round_, "n": n_now, "alpha": alpha, "alpha_spent": spent,
                "verdicts": _counts(current.values(), len(seeds) * len(others)),
                "added": [f"{v}@{scale} seed {s}" for v, scale, s in added],
                "decisions": [current[k].to_dict() for k in sorted(current)]}
        out.looks.append(look)
        record(look)
        if stop:
            out.stopped = stop
            return out
        out.gpu_hours += sum(cost(r) for r in added)
        for _, scale, s in added:
            if s not in seeds[scale]:
                seeds[scale].append(s)
        execute(added)
        n_before, n_now = n_now, n_now + 1
    out.stopped = f"every planned look is made ({caps.max_seeds} seeds)"
    return out


def _planned(runs: pd.DataFrame, seeds: dict[str, list[int]]) -> pd.DataFrame:
    """Only the seeds this look is planned on, so a relaunch replays every look exactly."""
    if runs.empty:
        return runs
    planned = {(scale, seed) for scale, ss in seeds.items() for seed in ss}
    return runs[[(sc, int(sd)) in planned for sc, sd in zip(runs["scale"], runs["seed"])]]


def _next_round(open_: list[tuple[str, str]], seeds: dict[str, list[int]], baseline: str, n_now: int, caps: Caps,
                hours: float, cost: Callable[[Run], float]) -> tuple[list[Run], str]:
    if not open_:
        return [], "every comparison is decided"
    # a scale that started with more seeds than others reaches the cap sooner
    growing = sorted({scale for scale, _ in open_ if len(seeds[scale]) < caps.max_seeds})
    if n_now >= caps.max_seeds or not growing:
        return [], f"max seeds reached ({caps.max_seeds}) with {len(open_)} undecided"
    added: list[Run] = []
    for scale in growing:
        seed = max(seeds[scale]) + 1
        added.append((baseline, scale, seed))
        added += [(v, scale, seed) for s, v in open_ if s == scale]
    more = sum(cost(r) for r in added)
    if caps.max_gpu_hours is not None and hours + more > caps.max_gpu_hours:
        return [], (f"GPU-hour cap: the next round needs {more:,.1f} more, {hours:,.1f} of "
                    f"{caps.max_gpu_hours:g} are spent; {len(open_)} undecided")
    return added, ""


def _counts(decisions, total: int) -> dict[str, int]:
    counts = Counter(d.verdict for d in decisions)
    if total > counts.total():
        counts["undecided"] += total - counts.total()
    return dict(counts)


def final_decisions(looks: Sequence[dict]) -> dict[tuple[str, str], dict]:
    """Per (scale, variant): its row at the look that decided it, else at the last look."""
    out: dict[tuple[str, str], dict] = {}
    for look in looks:
        for row in look["decisions"]:
            key = (row["scale"], row["variant"])
            if key not in out or out[key]["verdict"] == "undecided":
                out[key] = row
    return out


def log_look(client, experiment_id: str, run_id: str | None, look: dict, looks: list[dict]) -> str:
    """Record one look in the experiment's sequential MLflow run (created at the first look)."""
    from mlflow.entities import Metric

    if run_id is None:
        run_id = client.create_run(experiment_id, run_name="until-decided",
                                   tags={TAG_ROLE: ROLE_SEQUENTIAL}).info.run_id
    step = look["round"]
    metrics = [Metric("look/alpha", look["alpha"], 0, step), Metric("look/alpha_spent", look["alpha_spent"], 0, step),
               Metric("look/n", look["n"], 0, step)]
    metrics += [Metric(f"look/{v}", n, 0, step) for v, n in look["verdicts"].items()]
    for row in look["decisions"]:
        prefix = f"look/{row['scale']}/{row['variant']}"
        metrics += [Metric(f"{prefix}/{k}", row[k], 0, step) for k in ("n", "mean_delta", "ci_low", "ci_high")
                    if row.get(k) is not None]
    client.log_batch(run_id, metrics=metrics)
    for row in look["decisions"]:
        client.set_tag(run_id, f"study.verdict.{row['scale']}.{row['variant']}", row["verdict"])
    client.log_dict(run_id, looks, LOOKS_ARTIFACT)
    return run_id


def read_looks(client, experiment_id: str) -> list[dict]:
    """The looks of the experiment's latest sequential run; [] when there is none (or its first look is uploading)."""
    return latest_record(client, experiment_id, ROLE_SEQUENTIAL, LOOKS_ARTIFACT) or []
