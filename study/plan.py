"""Expand an experiment into runs: composed configs, run keys, matched shapes, budgets, FLOPs and GPU-hours."""

from __future__ import annotations

import copy
import functools
import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from study.budget import Matched, flops_per_token, match, reference_budget
from study.config import GROUPS, RunConfig, compose, run_key, run_name, split_overrides, sweeps_dir
from study.errors import StudyError
from study.experiment import Experiment, load_experiment
from study.validate import validate_run


@dataclass
class PlannedRun:
    cfg: RunConfig
    """Composed config, before matching (what the run key hashes)."""
    key: str
    """Run key."""
    matched: Matched
    """Resolved shape and parameter accounting; `matched.params` is None while widths wait for a profile."""
    pending: str | None = None
    """Why the widths are not known yet (the stage that will produce them)."""
    depends_on: list[str] = field(default_factory=list)
    """Run keys that must finish first (a scheduled run's reference)."""

    @property
    def name(self) -> str:
        return run_name(self.cfg)

    def tokens(self) -> int:
        t = self.cfg.train
        seqs = t.global_batch or t.micro_batch * t.grad_accum
        if t.max_steps:
            return t.max_steps * seqs * self.cfg.data.seq_len
        if self.matched.params is None:
            return 0
        return int(t.tokens_per_param * self.matched.params.counted)

    def flops_per_token(self) -> float | None:
        if self.matched.params is None:
            return None
        return flops_per_token(self.matched.model, self.cfg.data.seq_len)

    def gpu_hours(self) -> float | None:
        fpt = self.flops_per_token()
        if fpt is None:
            return None
        t = self.cfg.train
        return self.tokens() * fpt / (t.gpu_peak_tflops * 1e12 * t.assumed_mfu) / 3600

    def as_json(self) -> dict[str, Any]:
        m = self.matched.model
        ffn = m.ffn
        return {
            "run_key": self.key, "name": self.name, "variant": self.cfg.variant, "scale": self.cfg.scale,
            "seed": self.cfg.seed, "stage": self.cfg.stage, "baseline": self.cfg.baseline,
            "model": {
                "block": m.block, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
                "n_kv_heads": m.kv_heads, "head_dim": m.dim_head, "vocab_size": m.vocab_size,
                "tie_embeddings": m.tie_embeddings,
                "ffn": {"kind": ffn.kind, "schedule": ffn.schedule, "widths": ffn.widths, "k": ffn.k,
                        "sub_norm": ffn.sub_norm if ffn.kind == "hourglass" else False},
            },
            "params": self.matched.params.as_dict() if self.matched.params else None,
            "budget": self.matched.budget, "budget_mode": self.cfg.budget.mode, "mismatch": self.matched.mismatch,
            "pending": self.pending, "depends_on": self.depends_on,
            "tokens": self.tokens(), "flops_per_token": self.flops_per_token(), "gpu_hours": self.gpu_hours(),
        }


@dataclass
class Plan:
    experiment: Experiment
    runs: list[PlannedRun]

    def as_json(self) -> dict[str, Any]:
        return {"experiment": self.experiment.name, "baseline": self.experiment.baseline,
                "runs": [r.as_json() for r in self.runs]}


def run_dir(cfg: RunConfig, key: str) -> Path:
    """Deterministic home of a run: checkpoints, logs, its geometry profile."""
    return Path(cfg.paths.runs).resolve() / cfg.experiment / key


def profile_path(cfg: RunConfig, key: str) -> Path:
    return run_dir(cfg, key) / "profile.json"


def _nested(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def with_budget(cfg: RunConfig, reference: RunConfig) -> RunConfig:
    """Fix the run's budget to the count of `reference` (the scale's conventional model with the same settings)."""
    if cfg.budget.target:
        return cfg
    return replace(cfg, budget=replace(cfg.budget, target=reference_budget(reference.model, cfg.budget.mode)))


def compose_run(exp: Experiment, variant, scale: str, overrides: list[str]) -> RunConfig:
    identity = {"experiment": exp.name, "variant": variant.name, "baseline": exp.baseline, "scale": scale}
    # A string under a config group in `common` selects that group's file (`data: openwebtext`).
    groups = {k: v for k, v in exp.common.items() if k in GROUPS and isinstance(v, str)}
    common = {k: v for k, v in exp.common.items() if k not in groups}
    return compose({**groups, "scale": scale, "model": variant.model},
                   layers=[identity, common, _nested(variant.settings)], overrides=overrides)


@functools.lru_cache(maxsize=None)
def scale_budget(scale: str, mode: str) -> int:
    """The budget of a scale: its reference conventional model's count."""
    return reference_budget(compose({"scale": scale, "model": "conventional"}, overrides=[]).model, mode)


def match_run(cfg: RunConfig) -> Matched:
    budget = cfg.budget.target or scale_budget(cfg.scale, cfg.budget.mode)
    try:
        return match(copy.deepcopy(cfg.model), budget, cfg.budget)
    except StudyError as err:
        raise StudyError(err.field, f"{err.problem} (variant {cfg.variant}, scale {cfg.scale})", err.fix) from None


def resolve_model(cfg: RunConfig) -> Matched:
    """The run's matched shape: from the reference's geometry profile for scheduled runs, else from its schedule."""
    if cfg.model.ffn.schedule != "geometry":
        return match_run(cfg)
    path = Path(cfg.paths.profile) if cfg.paths.profile else None
    if path is None or not path.is_file():
        raise StudyError("paths.profile", f"the geometry-scheduled run {run_name(cfg)} has no reference profile"
                         + (f" at {path}" if path else ""),
                         "train the reference run and run `study profile RUN_KEY` first (study launch chains them)")
    from study.geometry.schedule import scheduled_model

    return scheduled_model(cfg, path, cfg.budget.target or scale_budget(cfg.scale, cfg.budget.mode))


def plan_experiment(name: str, overrides: list[str] | None = None) -> Plan:
    """Every run of the experiment, matched to its scale's budget. Seeds only change the seed: a (variant, scale)
    is composed and matched once."""
    exp = load_experiment(name)
    overrides = list(overrides or [])
    runs: list[PlannedRun] = []
    from study.experiment import Variant

    for scale in exp.scales:
        reference = compose_run(exp, Variant("reference", "conventional"), scale, overrides)
        ref_key = None
        if exp.reference:
            ref_variant = next(v for v in exp.variants if v.name == exp.reference[0])
            ref_cfg = replace(with_budget(compose_run(exp, ref_variant, scale, overrides), reference),
                              seed=exp.reference[1], stage="reference")
            ref_key = run_key(ref_cfg)
        for variant in exp.variants:
            base = with_budget(compose_run(exp, variant, scale, overrides), reference)
            validate_run(base)
            scheduled = base.model.ffn.schedule == "geometry"
            if scheduled and not exp.reference:
                raise StudyError(f"{name}.yaml: reference", f"variant {variant.name} needs a reference run to profile",
                                 "add `reference: {variant: <uniform variant>, seed: 0}` to the experiment")
            matched = match_run(base) if not scheduled else None
            for seed in exp.seeds[scale]:
                is_ref = exp.reference == (variant.name, seed)
                cfg = replace(base, seed=seed, stage="reference" if is_ref else ("scheduled" if scheduled else base.stage))
                key = run_key(cfg)
                if scheduled:
                    runs.append(_scheduled(cfg, key, ref_cfg, ref_key))
                else:
                    runs.append(PlannedRun(cfg, key, matched))
    return Plan(exp, runs)


def _scheduled(cfg: RunConfig, key: str, ref_cfg: RunConfig, ref_key: str) -> PlannedRun:
    """A geometry-scheduled run: widths from the reference's profile once it exists, else pending."""
    path = profile_path(ref_cfg, ref_key)
    cfg = replace(cfg, paths=replace(cfg.paths, profile=str(path)))
    if path.is_file():
        return PlannedRun(cfg, key, resolve_model(cfg), None, [ref_key])
    budget = match_run(dataclasses.replace(cfg, model=ref_cfg.model, budget=ref_cfg.budget)).budget
    return PlannedRun(cfg, key, Matched(cfg.model, None, budget, None),
                      f"profile of reference run {ref_key} ({ref_cfg.variant} seed {ref_cfg.seed})", [ref_key])


def run_from_overrides(overrides: list[str]) -> RunConfig:
    """The config `study train`/`study eval` act on: `experiment=X variant=V scale=S seed=N` picks that planned run
    (the same config and key as `study launch`); without an experiment file, the overrides compose an ad-hoc run."""
    fields = {k: v for k, v in (o.split("=", 1) for o in overrides if "=" in o)}
    name = fields.get("experiment")
    if name is None or not (sweeps_dir() / "experiment" / f"{name}.yaml").is_file():
        groups, values = split_overrides(overrides)
        reference = compose({**groups, "model": "conventional"}, overrides=values)
        return with_budget(compose(overrides=overrides), reference)
    selectors = ("experiment", "variant", "scale", "seed")
    rest = [o for o in overrides if o.split("=", 1)[0] not in selectors]
    plan = plan_experiment(name, rest)
    wanted = {k: fields[k] for k in selectors[1:] if k in fields}
    found = [r for r in plan.runs if all(str(getattr(r.cfg, k)) == v for k, v in wanted.items())]
    if len(found) != 1:
        choices = sorted({f"variant={r.cfg.variant} scale={r.cfg.scale} seed={r.cfg.seed}" for r in plan.runs})
        raise StudyError("variant/scale/seed", f"{len(found)} runs of experiment {name} match "
                         f"{' '.join(f'{k}={v}' for k, v in wanted.items()) or 'nothing given'}",
                         f"name one run, e.g. {choices[0]}")
    return found[0].cfg
