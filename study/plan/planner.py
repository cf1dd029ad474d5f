"""Expand an experiment (or one ad-hoc run) into run specs: composed configs, keys, matched shapes, budgets.

The experiment file owns `experiment`, `variant`, `scale`, `seed` (and `baseline`, `role`): command-line overrides
apply to every run, `variants.<name>.<key>=value` to one variant's runs. A (variant, scale) is composed and matched
once; its seeds differ in the seed only.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from study.config.compose import GROUPS, RENAMED, Overrides, compose, group_options, nested, parse_overrides
from study.config.identity import run_key
from study.config.run import Role, RunConfig, run_name
from study.config.recipe import PENDING, Tuned, final_lr_for, resolve_recipe
from study.config.spec import RunSpec, finished_loss
from study.errors import StudyError
from study.plan.branches import check_schedule, expand
from study.plan.budget import Matched, flops_per_token, match, reference_budget
from study.plan.experiment import Experiment, Variant, load_experiment
from study.plan.fairness import OWNED, check_arms
from study.plan.memory import estimable, fit_micro_batch
from study.plan.tune import EDGE, EXTENDED, INTERIOR, Choice, Point, all_diverged, choose, grid_with_extensions, \
    read_record, record_path, transfer
from study.schema import RunDir


@dataclass
class Plan:
    experiment: Experiment
    runs: list[RunSpec]
    overrides: list[str]
    """The command-line overrides the plan was made with (the launch manifest records them)."""
    extra_seeds: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """Seeds added beyond the experiment file's, per scale and variant (an adaptive launch's)."""
    tunings: dict[str, VariantTuning] = field(default_factory=dict)
    """Each tuned variant's tune runs and choice (experiments with `tune:`)."""

    def as_json(self) -> dict[str, Any]:
        return {"experiment": self.experiment.name, "baseline": self.experiment.baseline,
                "overrides": self.overrides, "runs": [spec_json(r) for r in self.runs],
                "tunings": {v: {"record": str(t.record), "choices": None if t.choices is None else
                                {s: {"multiple": c.multiple, "status": c.status, "best": c.best}
                                 for s, c in t.choices.items()}} for v, t in self.tunings.items()}}


@dataclass
class VariantTuning:
    """One variant's tuning as planned: its tune runs and, once they decide, its choice per tune scale."""

    variant: str
    """The variant tuned."""
    record: Path
    """Where its choices are recorded, once."""
    runs: list[RunSpec]
    """Its tune runs: every grid point (and extension) x tune seed at every tune scale."""
    choices: dict[str, Choice] | None
    """Tune scale -> the choice; None while a tune run it needs has not finished."""
    rule_lr: dict[str, float]
    """Tune scale -> the recipe's peak LR there (what the multiples multiply)."""
    budgets: dict[str, int]
    """Tune scale -> its budget (for fitting the optimum against N)."""
    recorded: bool = False
    """The choices were read from the record (else a launch writes them there)."""
    grid_keys: list[str] = field(default_factory=list)
    """Keys of the declared grid's tune runs at every tune scale, which a main run's key includes."""
    note: str = ""
    """Why the choice is not made or not read from the record (a grid diverged everywhere, a stale record)."""

    def identity(self, tuning) -> dict[str, Any]:
        """What a tuned main run's key hashes of its tuning: the tune block and the tune runs it declares."""
        return {**tuning.identity(), "runs": self.grid_keys}


def spec_json(spec: RunSpec) -> dict[str, Any]:
    """One run of `study plan --json`."""
    from study.plan.throughput import devices

    m, cfg = spec.model, spec.config
    hours, n, layers = spec.gpu_hours(), devices(spec), range(m.n_layers)
    depth = {"depth": m.init_depth} if m.init_rule == "depth_scaled" else {}
    return {
        "run_key": spec.key, "name": spec.name, "variant": cfg.variant, "scale": cfg.scale, "seed": cfg.seed,
        "role": cfg.role, "baseline": cfg.baseline,
        "model": {
            "block": m.block, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
            "n_kv_heads": m.kv_heads, "head_dim": m.dim_head, "vocab_size": m.vocab_size,
            "tie_embeddings": m.tie_embeddings, "layer_heads": [m.q_heads(l) for l in layers],
            "layer_kv_heads": [m.kv_heads_of(l) for l in layers],
            "ffn": {"kind": m.ffn.kind, "schedule": m.ffn.schedule.family, "widths": m.ffn.widths, "k": m.ffn.k,
                    "sub_norm": m.ffn.sub_norm if m.ffn.kind == "hourglass" else False,
                    "width_schedule": asdict(m.ffn.schedule)},
        },
        "d_model_per_layer": m.d_model / m.n_layers,
        "params": spec.params, "budget": spec.budget, "budget_mode": cfg.budget.mode, "mismatch": spec.mismatch,
        "mismatch_total": spec.mismatch_total, "pending": spec.pending, "depends_on": spec.depends_on,
        "tokens": spec.tokens(), "flops_per_token": spec.flops_per_token, "gpu_hours": hours,
        "nodes": cfg.cluster.nodes, "devices": n, "wall_days": None if hours is None else hours / 24 / n,
        **{f: getattr(spec.planned, f) for f in RECIPE_JSON},
        "tuned": asdict(spec.tuned) if spec.tuned is not None else None,
        "points": [asdict(p) for p in spec.points], "trunk": spec.trunk,
        "init": {"rule": m.init_rule, "std": m.init_std, **depth},
    }


RECIPE_JSON = ("max_steps", "lr", "warmup_steps", "final_lr", "lr_schedule", "decay_fraction", "global_batch",
               "micro_batch", "grad_accum", "world_size", "lr_rule", "val_windows")
"""Recipe fields each run of `study plan --json` shows beside `tokens` (study/config/recipe.py)."""


def experiment_overrides(exp: Experiment, items: list[str]) -> tuple[Overrides, dict[str, dict[str, Any]]]:
    """Overrides for every run, and per-variant ones (`variants.hourglass.model.ffn.k=8`)."""
    ov = parse_overrides(items)
    for key in [*ov.groups, *ov.values, *ov.reset]:
        if key.split(".")[0] in OWNED:
            raise StudyError(key, f"is set by the experiment file {exp.name}.yaml for each of its runs",
                             "select runs with --variant/--scale/--seed (study plan, status), change the experiment "
                             "file, or set a variant's own value with variants.<name>.<key>=value, "
                             f"e.g. variants.{exp.variants[-1].name}.model.ffn.k=8")
    names = [v.name for v in exp.variants]
    per_variant: dict[str, dict[str, Any]] = {}
    for key in [k for k in ov.values if k.startswith("variants.")]:
        parts = key.split(".", 2)
        if len(parts) < 3 or parts[1] not in names:
            raise StudyError(key, f"names no variant of {exp.name}" if len(parts) == 3 else "sets no field",
                             f"write variants.<name>.<key>=value with a name from {', '.join(names)}")
        if parts[2] in RENAMED:
            raise StudyError(key, f"was renamed to variants.{parts[1]}.{RENAMED[parts[2]]}",
                             "write the new name instead (the run key is the same)")
        if parts[2].split(".")[0] in OWNED:
            raise StudyError(key, "sets a field the experiment file owns", "change the experiment file instead")
        per_variant.setdefault(parts[1], {})[parts[2]] = ov.values.pop(key)
    return ov, per_variant


def compose_run(exp: Experiment, variant: Variant, scale: str, ov: Overrides,
                own: dict[str, Any] | None = None) -> RunConfig:
    identity = {"experiment": exp.name, "variant": variant.name, "baseline": exp.baseline, "scale": scale}
    # A string under a config group in `common` selects that group's file (`data: openwebtext`).
    groups = {k: v for k, v in exp.common.items() if k in GROUPS and isinstance(v, str)}
    common = {k: v for k, v in exp.common.items() if k not in groups}
    layers = [(identity, "the experiment's identity"), (common, f"{exp.name}.yaml: common"),
              # every run of a branched experiment, tune runs included, decays over the branches' fraction
              ({"train": {"decay_fraction": exp.branches.decay}} if exp.branches else {}, f"{exp.name}.yaml: branches"),
              (nested(exp.per_scale.get(scale, {})), f"{exp.name}.yaml: at.{scale}"),
              (nested(variant.settings), f"{exp.name}.yaml: variants.{variant.name}"),
              (nested(variant.per_scale.get(scale, {})), f"{exp.name}.yaml: variants.{variant.name}.at.{scale}")]
    run_ov = replace(ov, values={**ov.values, **(own or {})})
    return compose({**groups, "scale": scale, "model": variant.model}, layers=layers, overrides=run_ov)


def with_budget(cfg: RunConfig, reference: RunConfig) -> RunConfig:
    """Fix what the scale's reference (its conventional model with the same settings) decides for every arm: the
    budget (its count), and the depth a `depth_scaled` init divides by (its L), so no arm's init reads its own shape."""
    if cfg.model.init_rule == "depth_scaled" and not cfg.model.init_depth:
        cfg = replace(cfg, model=replace(cfg.model, init_depth=reference.model.n_layers))
    if cfg.budget.target:
        return cfg
    return replace(cfg, budget=replace(cfg.budget, target=reference_budget(reference.model, cfg.budget.mode)))


def match_run(cfg: RunConfig) -> Matched:
    try:
        return match(copy.deepcopy(cfg.model), cfg.budget.target, cfg.budget)
    except StudyError as err:
        raise StudyError(err.field, f"{err.problem} (variant {cfg.variant}, scale {cfg.scale})", err.fix) from None


def make_spec(cfg: RunConfig, key: str, matched: Matched | None, reference: RunConfig,
              depends_on: list[str] | None = None, profile: str = "", pending: str | None = None) -> RunSpec:
    rdir = RunDir.of(cfg.paths.runs, cfg.experiment, key)
    ref_total = reference_budget(reference.model, "total")
    model = matched.model if matched else cfg.model

    def fit(global_batch: int) -> tuple[int, int]:  # train.micro_batch: auto, on the matched model's estimate
        return fit_micro_batch(cfg, estimable(model, cfg.budget.target, cfg.budget.mode), global_batch)

    recipe = resolve_recipe(cfg, cfg.budget.target, fit)
    if matched is None:
        return RunSpec(key, run_name(cfg), cfg, str(rdir.path), cfg.budget.target, depends_on=list(depends_on or []),
                       profile=profile, pending=pending, reference_total=ref_total, recipe=recipe)
    return RunSpec(key, run_name(cfg), replace(cfg, model=matched.model), str(rdir.path), matched.budget,
                   asdict(matched.params), matched.mismatch, flops_per_token(matched.model, cfg.data.seq_len),
                   list(depends_on or []), profile, None, ref_total, recipe)


def plan_experiment(name: str, overrides: list[str] | None = None,
                    extra_seeds: dict[str, dict[str, list[int]]] | None = None) -> Plan:
    """Every run of the experiment as a spec, matched to its scale's budget; ``extra_seeds[scale][variant]`` adds
    seeds beyond the experiment file's (what an adaptive launch trains where a comparison is undecided)."""
    from study.plan.complete import complete_spec

    exp = load_experiment(name)
    if (dup := next((s for s in exp.scales if exp.scales.count(s) > 1), None)) is not None:
        raise StudyError(f"{exp.name}.yaml: scales", f"lists scale {dup} twice", "list every scale once")
    for scale, seeds in exp.seeds.items():
        if (dup := next((s for s in seeds if seeds.count(s) > 1), None)) is not None:
            raise StudyError(f"{exp.name}.yaml: seeds", f"lists seed {dup} twice for scale {scale}",
                             "list every seed once (a repeated seed would train the same run twice)")
    ov, per_variant = experiment_overrides(exp, list(overrides or []))
    tunings = plan_tunings(exp, ov, per_variant) if exp.tuning else {}

    def tuning_id(variant: str) -> dict[str, Any] | None:  # what a run's key hashes of the tuning its LR comes from
        return tunings[variant].identity(exp.tuning) if exp.tuning else None

    runs: list[RunSpec] = []
    for scale in exp.scales:
        reference = compose_run(exp, Variant("reference", "conventional"), scale, ov)
        bases = {v.name: with_budget(compose_run(exp, v, scale, ov, per_variant.get(v.name)), reference)
                 for v in exp.variants}
        check_arms(name, scale, exp.baseline, bases, exp.compares)
        ref_cfg = ref_key = None
        if exp.reference:
            ref_cfg = replace(bases[exp.reference[0]], seed=exp.reference[1], role=Role.reference)
            # the reference trains at its variant's tuned LR where the experiment tunes: its key hashes that tuning,
            # and the scheduled runs wait on the profile of exactly that run
            ref_key = run_key(ref_cfg, tuning=tuning_id(exp.reference[0]))
        for variant in exp.variants:
            base = bases[variant.name]
            scheduled = base.model.ffn.schedule.family == "geometry"
            if scheduled and not exp.reference:
                raise StudyError(f"{name}.yaml: reference", f"variant {variant.name} needs a reference run to profile",
                                 "add `reference: {variant: <uniform variant>, seed: 0}` to the experiment")
            matched = None if scheduled else match_run(base)
            tuned = tuning_id(_tuned_variant(exp, variant.name, scheduled))
            added = [s for s in (extra_seeds or {}).get(scale, {}).get(variant.name, []) if s not in exp.seeds[scale]]
            for seed in [*exp.seeds[scale], *added]:
                role = Role.scheduled if scheduled else Role.train
                cfg = replace(base, seed=seed, role=Role.reference if exp.reference == (variant.name, seed) else role)
                if scheduled:
                    profile = RunDir.of(ref_cfg.paths.runs, ref_cfg.experiment, ref_key).profile
                    spec = make_spec(cfg, run_key(cfg, [ref_key], tuned), None, reference, [ref_key], str(profile),
                                     f"profile of reference run {ref_key} ({ref_cfg.variant} seed {ref_cfg.seed})")
                    runs.append(complete_spec(spec) if profile.is_file() else spec)
                elif exp.branches:
                    check_schedule(cfg, exp.branches, f"{name}.yaml: branches")
                    runs += expand(make_spec(cfg, "", matched, reference), exp.branches, f"{name}.yaml: branches",
                                   tuning=tuned)
                else:
                    runs.append(make_spec(cfg, run_key(cfg, tuning=tuned), matched, reference))
    if exp.tuning:
        runs = [r for t in tunings.values() for r in t.runs] + [_with_tuning(r, exp, tunings) for r in runs]
    seen: dict[str, RunSpec] = {}
    for r in runs:
        if (first := seen.setdefault(r.key, r)) is not r:
            raise _same_run(name, first, r)
    return Plan(exp, runs, list(overrides or []), extra_seeds or {}, tunings)


def _tuned_variant(exp: Experiment, variant: str, scheduled: bool) -> str:
    """Whose tuning a variant's LR comes from: its own; a geometry-scheduled variant's is its reference variant's
    (its tune runs would need a profile of their own at the tune scale)."""
    return exp.reference[0] if scheduled and exp.reference else variant


def plan_tunings(exp: Experiment, ov: Overrides, per_variant: dict[str, dict[str, Any]]) -> dict[str, VariantTuning]:
    """Every tuned variant's tune runs, and its choice when they have all settled (or as recorded and checked)."""
    tuning = exp.tuning
    out: dict[str, VariantTuning] = {}
    for variant in exp.variants:
        runs: list[RunSpec] = []
        choices: dict[str, Choice] = {}
        rule_lr: dict[str, float] = {}
        budgets: dict[str, int] = {}
        grid_keys: dict[str, dict[tuple[float, int], str]] = {}
        by_key: dict[str, RunSpec] = {}
        blocked, record = "", None
        for scale in tuning.scales:
            reference = compose_run(exp, Variant("reference", "conventional"), scale, ov)
            base = with_budget(compose_run(exp, variant, scale, ov, per_variant.get(variant.name)), reference)
            if base.model.ffn.schedule.family == "geometry":
                break  # it takes its reference variant's tuning (_tuned_variant)
            record = record_path(base.paths.runs, exp.name, variant.name)
            matched = match_run(base)
            rule = resolve_recipe(base, base.budget.target)
            rule_lr[scale], budgets[scale] = rule.lr, base.budget.target
            specs: dict[tuple[float, int], RunSpec] = {}

            def tune_spec(p: Point, seed: int) -> RunSpec:
                cfg = replace(base, seed=seed, role=Role.tune, eval=replace(base.eval, after_train=False),
                              train=replace(base.train, lr=float(f"{p.multiple * rule.lr:.6g}")))
                spec = make_spec(cfg, run_key(cfg), matched, reference)
                return replace(spec, name=f"{spec.name}-lr{p.multiple:g}",
                               tuned=Tuned(p.multiple, "extension" if p.extension else "grid", str(record)))

            # the grid grows (extensions) as its points settle: read the losses until it adds no point
            results: dict[float, Point] = {}
            while True:
                points, decided = grid_with_extensions(tuning, results)
                for p in points:
                    for i, seed in enumerate(tuning.seeds):
                        if (p.multiple, seed) not in specs:
                            specs[p.multiple, seed] = tune_spec(p, seed)
                        p.losses[i] = finished_loss(specs[p.multiple, seed])
                    p.keys = [specs[p.multiple, seed].key for seed in tuning.seeds]
                if decided or results.keys() == {p.multiple for p in points}:
                    break
                results = {p.multiple: p for p in points}
            runs += [specs[p.multiple, seed] for p in points for seed in tuning.seeds]
            grid_keys[scale] = {(m, seed): specs[m, seed].key for m in tuning.lr for seed in tuning.seeds}
            by_key.update({spec.key: spec for spec in specs.values()})
            if decided and all_diverged(points):
                blocked = (f"every tune point of {variant.name} at {scale} diverged (x{points[0].multiple:g} to "
                           f"x{points[-1].multiple:g}): lower tune.lr (or raise tune.extend) so that some LR trains")
            elif decided:
                choices[scale] = choose(points, any(p.extension for p in points))
        if record is None:
            continue
        recorded, stale = read_record(record, tuning, grid_keys,
                                      lambda key: finished_loss(by_key[key]) if key in by_key else None)
        if recorded is not None:
            choices, blocked = recorded, ""
        decided = not blocked and len(choices) == len(tuning.scales)
        keys = sorted({k for g in grid_keys.values() for k in g.values()})
        out[variant.name] = VariantTuning(variant.name, record, runs, choices if decided else None, rule_lr, budgets,
                                          recorded is not None, keys, blocked or stale)
    return out


def _with_tuning(spec: RunSpec, exp: Experiment, tunings: dict[str, VariantTuning]) -> RunSpec:
    """A main run with the peak LR its variant's tuning chose, or marked as waiting for it (and why)."""
    t = tunings[_tuned_variant(exp, spec.config.variant, spec.role == Role.scheduled)]
    if t.choices is None:
        done = sum(finished_loss(r) is not None for r in t.runs)
        why = f"tuning of {t.variant} ({done} of {len(t.runs)} tune runs finished)"
        return replace(spec, tuned=Tuned(0.0, PENDING, str(t.record)),
                       pending=spec.pending or (f"{why}; {t.note}" if t.note else why))
    tuned_lr = {s: (c.multiple, c.multiple * t.rule_lr[s]) for s, c in t.choices.items()}
    lr, how = transfer(tuned_lr, t.budgets, spec.config.scale, spec.planned.lr)
    statuses = {c.status for c in t.choices.values()}
    status = EDGE if EDGE in statuses else EXTENDED if EXTENDED in statuses else INTERIOR
    recipe = replace(spec.planned, lr=lr, final_lr=final_lr_for(spec.config.train, lr), lr_rule=how)
    return replace(spec, recipe=recipe, tuned=Tuned(float(f"{lr / spec.planned.lr:.6g}"), status, str(t.record)))


def _same_run(name: str, a: RunSpec, b: RunSpec) -> StudyError:
    """Two planned runs that are one run, refused naming the setting meant to tell them apart (tune multiples, tune
    scales, scales or variants)."""
    same = f"{a.name} and {b.name} are the same run ({a.key})"
    x, y = a.config, b.config
    if a.role == b.role == Role.tune and x.variant == y.variant and x.scale == y.scale:
        return StudyError(f"{name}.yaml: tune.lr", f"{same}: multiples {a.tuned.multiple:.10g} and "
                          f"{b.tuned.multiple:.10g} give one peak LR, {x.train.lr:g}, at 6 significant digits",
                          "list multiples that differ in their first 6 significant digits, e.g. lr: [0.5, 1, 2]")
    if x.variant == y.variant and x.scale != y.scale:
        field = "tune.scales" if a.role == b.role == Role.tune else "scales"
        return StudyError(f"{name}.yaml: {field}", f"{same}: scales {x.scale} and {y.scale} compose the same model, "
                          "data and recipe", f"list scales that differ in what they train, or drop {y.scale} from "
                          f"{field}")
    return StudyError(f"{name}.yaml: variants", f"{same}: their configs differ in labels only",
                      "make the variants differ, or drop one")


def plan_adhoc(items: list[str]) -> RunSpec:
    """One run composed from overrides alone (experiment `adhoc`): `study train` and `python -m study.train` agree."""
    ov = parse_overrides(items)
    conventional = replace(ov, groups={**ov.groups, "model": "conventional"})
    cfg, reference = compose(overrides=ov), compose(overrides=conventional)
    cfg = with_budget(cfg, reference)
    if cfg.model.ffn.schedule.family == "geometry":
        raise StudyError("model.ffn.schedule", "a geometry-scheduled run needs the reference run of an experiment",
                         "train it through an experiment with a `reference` (study launch geometry)")
    return make_spec(cfg, run_key(cfg), match_run(cfg), reference)


def select_run(items: list[str]) -> RunSpec:
    """The spec `study train` acts on: the planned run `experiment=X variant=V scale=S seed=N` names (as `study
    launch` plans it), else an ad-hoc run."""
    selectors = ("experiment", "variant", "scale", "seed")
    picked = {i.split("=", 1)[0]: i.split("=", 1)[1] for i in items if "=" in i and i.split("=", 1)[0] in selectors}
    name = picked.get("experiment")
    if name is None or name not in group_options("experiment"):  # an ad-hoc run, filed under that experiment name
        return plan_adhoc(items)
    rest = [i for i in items if i.split("=", 1)[0] not in selectors]
    plan = plan_experiment(name, rest)
    wanted = {k: v for k, v in picked.items() if k != "experiment"}
    # tune runs share their variant, scale and seed with a main run: launches train them, never `study train`
    found = [r for r in plan.runs if r.role != Role.tune and all(str(getattr(r.config, k)) == v
                                                              for k, v in wanted.items())]
    if len(found) != 1:
        choices = sorted({f"variant={r.config.variant} scale={r.config.scale} seed={r.config.seed}" for r in plan.runs})
        raise StudyError("variant/scale/seed", f"{len(found)} runs of experiment {name} match "
                         f"{' '.join(f'{k}={v}' for k, v in wanted.items()) or 'nothing given'}",
                         f"name one run, e.g. {choices[0]}")
    return found[0]


def filter_runs(plan: Plan, variant: list[str] | None = None, scale: list[str] | None = None,
                seed: list[int] | None = None) -> Plan:
    """The plan restricted to some variants, scales or seeds (`--variant`, `--scale`, `--seed`)."""
    wanted = {"variant": variant, "scale": scale, "seed": seed}
    for key, values in wanted.items():
        have = {getattr(r.config, key) for r in plan.runs}
        if missing := sorted(set(values or []) - have, key=str):
            raise StudyError(f"--{key}", f"{missing[0]} is not in experiment {plan.experiment.name}",
                             f"use one of {', '.join(map(str, sorted(have, key=str)))}")
    return replace(plan, runs=[r for r in plan.runs if all(not values or getattr(r.config, key) in values
                                                            for key, values in wanted.items())])
