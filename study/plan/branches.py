"""Decay branches: many token budgets from one run at the stable LR (Hägele et al. 2024, "Scaling Laws and
Compute-Optimal Training Beyond Fixed Training Durations"), e.g. `branches: {at: [0.25, 0.5, 1.0], decay: 0.2}`.

A straight WSD run of L steps is the same computation for every L until it decays at L - int(decay x L): a step's
batch is a function of (seed, step) and the warm-up is the full run's. So each planned run becomes a trunk (role
`trunk`) at the stable LR to its last branch start, checkpointed at every start, and one branch per point (role
`branch`) that decays from the trunk's checkpoint, equal to the straight WSD run of its length. A trunk's key hashes
its points; a branch's is its trunk's key, its point and its decay (study.config.identity.branch_key).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from study.config.identity import branch_key, run_key
from study.config.recipe import BranchPoint, decay_start
from study.config.run import Role, RunConfig
from study.config.spec import RunSpec
from study.config.validate import is_number, refuse_unknown
from study.errors import StudyError
from study.schema import RunDir


@dataclass(frozen=True)
class Branches:
    """The `branches:` block of an experiment file."""

    at: tuple[float, ...]
    """Branch lengths as fractions of the run's planned steps, ascending (1.0 is the planned run itself)."""
    decay: float
    """Share of each branch spent decaying (the WSD schedule's `train.decay_fraction`, which the block sets)."""

    def identity(self) -> dict[str, Any]:
        """What a trunk's key hashes of its branches."""
        return {"at": list(self.at), "decay": self.decay}


def parse_branches(raw: Any, where: str) -> Branches:
    """The `branches:` block, checked: `at` a list of distinct positive fractions, `decay` in (0, 1)."""
    if not isinstance(raw, dict):
        raise StudyError(where, "must be a mapping", "write e.g. `branches: {at: [0.25, 0.5, 1.0], decay: 0.2}`")
    refuse_unknown(raw, ("at", "decay"), where, "a branches key", "use only at and decay")
    at, decay = raw.get("at"), raw.get("decay", 0.2)
    if not isinstance(at, list) or not at or any(not is_number(a) or not 0 < a <= 64 for a in at):
        raise StudyError(f"{where}.at", f"{at!r} is not a list of branch lengths",
                         "list fractions of the run's planned steps in (0, 64], e.g. at: [0.25, 0.5, 1.0]")
    if len(set(at)) != len(at):
        raise StudyError(f"{where}.at", f"{at!r} lists a point twice", "list every point once")
    if not is_number(decay) or not 0 < decay < 1:
        raise StudyError(f"{where}.decay", f"{decay!r} is not a fraction in (0, 1)",
                         "write the share of each branch spent decaying, e.g. decay: 0.2")
    return Branches(tuple(sorted(float(a) for a in at)), float(decay))


def branch_points(branches: Branches, max_steps: int, warmup: int, where: str) -> list[BranchPoint]:
    """Each point's length and trunk step for a run of `max_steps`, refused where a branch would start inside the
    warm-up or two would be the same run."""
    points = []
    for at in branches.at:
        length = round(at * max_steps)
        start = decay_start(length, branches.decay)  # where the straight WSD run of its length decays
        if start <= warmup or start >= length:
            raise StudyError(f"{where}.at", f"the branch at {at:g} ({length} of {max_steps} steps) would start at step "
                             f"{start}, {'inside the warm-up' if start <= warmup else 'with no decay'} "
                             f"({warmup} steps)", "use larger points, or a run with more steps")
        points.append(BranchPoint(at, length, start))
    if len({p.length for p in points}) != len(points):
        raise StudyError(f"{where}.at", f"two points give the same length at {max_steps} steps",
                         "use points further apart, or a run with more steps")
    return points


def check_schedule(cfg: RunConfig, branches: Branches, where: str) -> None:
    """Refused unless the run's schedule is WSD (a stable LR to branch from) and decays over `branches.decay` (any
    other `train.decay_fraction` would decay the trunk before its branches start)."""
    if cfg.train.lr_schedule != "wsd":
        raise StudyError("train.lr_schedule", f"is {cfg.train.lr_schedule!r}, and {where} needs a stable LR to branch "
                         "from", "set train: {lr_schedule: wsd} in the experiment's common block")
    if cfg.train.decay_fraction != branches.decay:
        raise StudyError("train.decay_fraction", f"is {cfg.train.decay_fraction:g} for variant {cfg.variant} at scale "
                         f"{cfg.scale}, and {where} decays each branch over {branches.decay:g}: every run of a "
                         "branched experiment decays over the branches' fraction",
                         "drop train.decay_fraction from the command line and from the experiment's at: and variants "
                         "blocks; set the decay once, in branches.decay")


def expand(spec: RunSpec, branches: Branches, where: str, tuning: dict[str, Any] | None = None) -> list[RunSpec]:
    """A planned run as its trunk (the longest branch's recipe, stable to its last branch start) and its branches
    (each the straight WSD run of its length, with the full run's warm-up)."""
    r = spec.planned
    points = branch_points(branches, r.max_steps, r.warmup_steps, where)
    per_step = r.tokens // r.max_steps
    # downstream tasks score the endpoint the report decides on (the longest branch), never the trunk's stable-LR
    # weights (evaluation is outside the key)
    quiet = replace(spec.config.eval, after_train=False)
    cfg = replace(spec.config, role=Role.trunk, eval=quiet)
    trunk_key = run_key(cfg, tuning=tuning, trunk=branches.identity())
    longest = points[-1].length
    trunk = replace(spec, key=trunk_key, name=f"{spec.name}-trunk", config=cfg, points=points,
                    dir=str(RunDir.of(cfg.paths.runs, cfg.experiment, trunk_key).path),
                    recipe=replace(r, max_steps=longest, tokens=longest * per_step))
    out = [trunk]
    for p in points:
        key = branch_key(trunk_key, p.at, branches.decay)
        bcfg = replace(spec.config, role=Role.branch, **({} if p is points[-1] else {"eval": quiet}))
        out.append(replace(spec, key=key, name=f"{spec.name}-at{p.at:g}", config=bcfg, points=[p], trunk=trunk_key,
                           dir=str(RunDir.of(bcfg.paths.runs, bcfg.experiment, key).path),
                           recipe=replace(r, max_steps=p.length, tokens=p.length * per_step)))
    return out
