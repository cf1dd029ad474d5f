"""Experiment files (`sweeps/experiment/*.yaml`): which variants, scales and seeds a study runs, and how."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from study.config.compose import group_file, group_options, plain_yaml, sweeps_dir
from study.config.decision import DecisionRule
from study.config.validate import SEED_MAX, refuse_unknown
from study.errors import StudyError
from study.plan.branches import Branches, parse_branches
from study.plan.fairness import check_compares, check_owned
from study.plan.paired_t import MIN_PAIRS
from study.plan.racing import Racing, parse_racing
from study.plan.tune import Tuning, parse_tuning
from study.schema import NAME


@dataclass
class Variant:
    name: str
    """Name in run names, tags and reports."""
    model: str
    """Preset in sweeps/model/ it starts from."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Dotted overrides on top of the preset (`model.ffn.k: 8`)."""
    per_scale: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Dotted overrides for one scale only, after `settings` (`at: {113M: {model.n_layers: 6}}`)."""


PUBLISHED_METRICS = ("val/loss", "val/ppl")
"""What a published value may be: both compare with our val/loss as a delta in nats (a perplexity ratio's log)."""


@dataclass(frozen=True)
class PublishedValue:
    value: float
    """The reported number, in the block's metric."""
    source: str
    """Where it is printed: the paper (arXiv id, version, table or section) or the authors' release."""
    verified: bool
    """Whether it was read in that source; a number taken from a summary or digest of it is not."""


@dataclass(frozen=True)
class Published:
    metric: str
    """`val/loss` or `val/ppl` (one of PUBLISHED_METRICS): what every value is."""
    values: dict[str, dict[str, PublishedValue]]
    """scale -> variant -> value; every scale listed has a value for the baseline, which the deltas are against."""


@dataclass
class Experiment:
    name: str
    """File name under sweeps/experiment/: the MLflow experiment name."""
    baseline: str
    """Variant every other variant is paired against."""
    scales: list[str]
    """Scale presets, in order."""
    seeds: dict[str, list[int]]
    """Seeds per scale."""
    variants: list[Variant]
    """Variants, in order."""
    reference: tuple[str, int] | None = None
    """(variant, seed) whose trained model is profiled for geometry-scheduled widths, per scale."""
    common: dict[str, Any] = field(default_factory=dict)
    """Overrides applied to every run."""
    per_scale: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Dotted overrides for every variant at one scale (`at: {906M: {train.lr: 2.5e-4}}`), after `common`."""
    description: str = ""
    """One line for the plan's title."""
    published: Published | None = None
    """The papers' reported figures (the `published:` block); the report compares their deltas with ours."""
    tuning: Tuning | None = None
    """The declared tuning (`tune:`): each variant's peak LR chosen from tune runs (study.plan.tune)."""
    decision: DecisionRule = field(default_factory=DecisionRule)
    """How the report, power and adaptive launch decide (the `decision:` block, checked once here)."""
    compares: tuple[str, ...] = ()
    """Shared fields the arms differ in on purpose (`compares: [train.lr]`, study.plan.fairness); else only models."""
    branches: Branches | None = None
    """Decay branches (`branches:`, study.plan.branches); None trains each run straight."""
    racing: Racing | None = None
    """Racing (`racing:`, analysis.racing); None (the default) trains every arm to its end."""


_NAME_FIX = "use letters, digits, _ . - (at most 100 characters)"
_SHAPE_FIX = "see sweeps/experiment/demo.yaml for the shape of an experiment file"
_PUBLISHED_KEYS = ("metric", "values", "source")
_VALUE_KEYS = ("value", "source", "verified")
_VALUE_FORM = "write e.g. `{value: 3.43, source: \"arXiv <id> v<n>, Table <k>\", verified: false}`"


def _published(name: str, raw: dict, baseline: str, scales: list[str], names: list[str]) -> Published:
    """The `published:` block, validated: a value is `{value, source, verified}`, or a bare number (the older form,
    unverified) with the block's `source`."""
    where = f"{name}.yaml: published"
    refuse_unknown(raw, _PUBLISHED_KEYS, where, "a published key",
                   f"use only {', '.join(_PUBLISHED_KEYS)} (a block-level source serves values that name none)")
    metric = raw.get("metric")
    if metric not in PUBLISHED_METRICS:
        raise StudyError(f"{where}.metric", "is missing" if metric is None else
                         f"{metric!r} is not a metric the report can compare in nats",
                         "use val/loss for reported losses or val/ppl for reported perplexities")
    default_source = raw.get("source")
    if default_source is not None and (not isinstance(default_source, str) or not default_source.strip()):
        raise StudyError(f"{where}.source", "must be a non-empty string",
                         "name the paper (arXiv id, version, table or section) or the authors' release")
    values = raw.get("values")
    if not isinstance(values, dict) or not values:
        raise StudyError(f"{where}.values", "must map scales to {variant: value}",
                         f"write e.g. `values: {{{scales[0]}: {{{baseline}: {{value: ..., source: ..., "
                         "verified: false}}}}`")
    out: dict[str, dict[str, PublishedValue]] = {}
    for scale, at in values.items():
        scale = str(scale)
        if scale not in scales:
            raise StudyError(f"{where}.values.{scale}", "is not a scale of the experiment",
                             f"use one of {', '.join(scales)}")
        if not isinstance(at, dict):
            raise StudyError(f"{where}.values.{scale}", f"must map variants to values, got {type(at).__name__}",
                             f"{_VALUE_FORM} per variant")
        out[scale] = {}
        for variant, entry in at.items():
            if variant not in names:
                raise StudyError(f"{where}.values.{scale}.{variant}", "is not a variant of the experiment",
                                 f"use one of {', '.join(names)}, or leave out a design this study does not run")
            out[scale][variant] = _published_value(f"{where}.values.{scale}.{variant}", entry, default_source)
        if baseline not in out[scale]:
            raise StudyError(f"{where}.values.{scale}", f"has no value for the baseline {baseline!r}",
                             "add the paper's baseline value at that scale: every comparison is a delta against it")
    return Published(metric, out)


def _published_value(where: str, entry: Any, default_source: str | None) -> PublishedValue:
    if _is_number(entry):
        if default_source is None:
            raise StudyError(where, "names no source", f"{_VALUE_FORM}, or give the block a `source:`")
        return PublishedValue(_positive(where, entry), default_source.strip(), False)
    if not isinstance(entry, dict):
        raise StudyError(where, f"must be a number or a mapping, got {type(entry).__name__}", _VALUE_FORM)
    refuse_unknown(entry, _VALUE_KEYS, where, "a key of a published value", _VALUE_FORM)
    if not _is_number(entry.get("value")):
        raise StudyError(f"{where}.value", f"must be a number, got {entry.get('value')!r}", _VALUE_FORM)
    source = entry.get("source", default_source)
    if not isinstance(source, str) or not source.strip():
        raise StudyError(f"{where}.source", "must name where the value is printed",
                         "give the paper (arXiv id, version, table or section) or the authors' release")
    verified = entry.get("verified")
    if not isinstance(verified, bool):
        raise StudyError(f"{where}.verified", f"must be true or false, got {verified!r}",
                         "write `verified: false` unless the value was read in the source itself")
    return PublishedValue(_positive(f"{where}.value", entry["value"]), source.strip(), verified)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _positive(where: str, x: float) -> float:
    # a perplexity's log and a loss are only defined for positive finite numbers
    if not math.isfinite(x) or x <= 0:
        raise StudyError(where, f"{x!r} is not a positive finite number", "copy the value the source reports")
    return float(x)


def _grid_variants(grid: dict[str, Any]) -> list[Variant]:
    if not grid["model"]:
        raise StudyError("grid", "needs `model` (a preset) and `set` (keys, lists for swept ones)",
                         "see sweeps/experiment/search.yaml")
    settings = grid.get("set") or {}
    swept = [k for k, v in settings.items() if isinstance(v, list)]
    fixed = {k: v for k, v in settings.items() if k not in swept}
    out = []
    for values in itertools.product(*(settings[k] for k in swept)):
        point = dict(zip(swept, values))
        name = grid["model"] + "".join(f"_{k.rsplit('.', 1)[-1]}{v}" for k, v in point.items())
        out.append(Variant(name, grid["model"], {**fixed, **point}))
    return out


@dataclass
class VariantFile:
    """A variant as its file writes it (`variants.<name>:`)."""

    model: str | None = None
    """Preset in sweeps/model/ it starts from; unset: the preset named like the variant."""
    set: dict[str, Any] = field(default_factory=dict)
    """Dotted overrides on top of the preset."""
    at: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Dotted overrides per scale name."""


@dataclass
class ReferenceFile:
    """The `reference:` block: the run profiled for geometry-scheduled widths."""

    variant: str = ""
    """Variant whose run is profiled."""
    seed: int = 0
    """Its seed."""


@dataclass
class GridFile:
    """The `grid:` block: one variant per point of the swept `set` values."""

    model: str = ""
    """Preset every point starts from."""
    set: dict[str, Any] = field(default_factory=dict)
    """Dotted keys; a list is swept, a scalar fixed."""


@dataclass
class ExperimentFile:
    """An experiment file's shape, checked like `RunConfig` (an unknown key or a wrong type names the field); the
    blocks with their own parsers (`published`, `decision`, `tune`, `branches`, `racing`) are mappings here."""

    baseline: str | None = None
    """Variant every other variant is paired against."""
    scales: list[str] | None = None
    """Scale presets, in order."""
    seeds: Any = None
    """Seeds: a list for every scale, or a mapping scale -> list."""
    variants: dict[str, VariantFile | None] = field(default_factory=dict)
    """Variant name -> its preset and settings."""
    description: str = ""
    """One line for the plan's title."""
    reference: ReferenceFile | None = None
    """The profiled reference run (geometry-scheduled studies)."""
    grid: GridFile | None = None
    """Variants swept over a grid of settings."""
    common: dict[str, Any] = field(default_factory=dict)
    """Overrides for every run."""
    at: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Dotted overrides for every variant at one scale."""
    published: dict[str, Any] | None = None
    """The papers' figures (`_published`)."""
    decision: dict[str, Any] | None = None
    """How the report decides (`DecisionRule.from_mapping`)."""
    tune: dict[str, Any] | None = None
    """The tuning (`parse_tuning`)."""
    compares: list[str] | None = None
    """Shared fields the arms differ in on purpose (`check_compares`)."""
    branches: dict[str, Any] | None = None
    """Decay branches (`parse_branches`)."""
    racing: Any = None
    """Racing: true, or a mapping (`parse_racing`)."""


def _read_file(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The file checked against `ExperimentFile`, as plain containers (interpolations kept for the composer)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(ExperimentFile)
    try:
        typed = OmegaConf.merge(schema, raw)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ".".join(map(str, _failing_path(schema, raw) or ()))
        kind = "is not an experiment key" if "not in" in str(exc) else "has the wrong type"
        raise StudyError(f"{name}.yaml: {key}".rstrip(": "), f"{kind} ({str(exc).splitlines()[0]})",
                         _SHAPE_FIX) from None
    out = OmegaConf.to_container(typed, resolve=False)
    for vname in out["variants"]:
        if not NAME.match(str(vname)):
            raise StudyError(f"{name}.yaml: variants.{vname}", "is not a usable variant name", _NAME_FIX)
    return out


def _failing_path(schema, value: Any, path: tuple = ()) -> tuple | None:
    """The deepest key path whose value alone does not merge onto `schema` (OmegaConf names no key for a mapping
    given a list)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for key, inner in value.items() if isinstance(value, dict) else ():
        alone = functools.reduce(lambda nested, part: {part: nested}, reversed((*path, key)), inner)
        try:
            OmegaConf.merge(schema, alone)
        except OmegaConfBaseException:
            return _failing_path(schema, inner, (*path, key)) or (*path, key)
    return None


def load_experiment(name: str) -> Experiment:
    if not NAME.match(name):
        raise StudyError("EXPERIMENT", f"{name[:120]!r} is not an experiment name", _NAME_FIX)
    path = sweeps_dir() / "experiment" / f"{name}.yaml"
    if not path.is_file():
        raise StudyError("EXPERIMENT", f"no experiment named {name!r}",
                         f"use one of {', '.join(group_options('experiment'))} (files in {path.parent})")
    raw, y = plain_yaml(path), f"{name}.yaml"
    if not isinstance(raw, dict):
        raise StudyError(y, "is not a mapping of experiment keys", _SHAPE_FIX)
    f = _read_file(name, raw)
    for key in ("baseline", "scales", "seeds", "variants"):
        if key not in raw and not (key == "variants" and "grid" in raw):
            raise StudyError(f"{y}: {key}", "is missing", "every experiment names baseline, scales, seeds, variants")
    scales = list(f["scales"] or [])
    if not scales:  # nothing would be planned, and `study plan` would say "no runs" as if that were the design
        raise StudyError(f"{y}: scales", "lists no scale", "list at least one, e.g. scales: [tiny]")
    for scale in scales:
        group_file("scale", scale)
    seeds = _seeds(f"{y}: seeds", f["seeds"], scales)
    variants = []
    for vname, spec in f["variants"].items():
        spec = spec or {}
        preset = spec.get("model") or vname
        group_file("model", preset)
        at = _per_scale(spec.get("at"), f"{y}: variants.{vname}.at", scales)
        variants.append(Variant(vname, preset, spec.get("set") or {}, at))
    if f["grid"] is not None:
        variants += _grid_variants(f["grid"])
    names = [v.name for v in variants]
    if f["baseline"] not in names:
        raise StudyError(f"{y}: baseline", f"{f['baseline']!r} is not one of the variants",
                         f"use one of {', '.join(names)}")
    reference = None if f["reference"] is None else (f["reference"]["variant"], f["reference"]["seed"])
    if reference is not None and reference[0] not in names:
        raise StudyError(f"{y}: reference.variant", f"{reference[0]!r} is not a variant",
                         f"use one of {', '.join(names)}")
    common = f["common"]
    per_scale = _per_scale(f["at"], f"{y}: at", scales)
    # every block is refused here, before anything is planned
    published = _published(name, f["published"], f["baseline"], scales, names) if f["published"] else None
    decision = DecisionRule.from_mapping(f["decision"], f"{y}: decision")
    tuning = parse_tuning(f["tune"], f"{y}: tune", lambda s: group_file("scale", s)) if f["tune"] is not None else None
    compares = check_compares(f["compares"], f"{y}: compares") if f["compares"] is not None else ()
    branches = parse_branches(f["branches"], f"{y}: branches") if f["branches"] is not None else None
    racing = parse_racing(f["racing"], f"{y}: racing", branches)
    if racing is not None and (few := [s for s in scales if len(seeds[s]) < MIN_PAIRS]):
        raise StudyError(f"{y}: racing", f"stops an arm decided at a branch point, and a paired test needs "
                         f"{MIN_PAIRS} seeds: scale {few[0]} has {len(seeds[few[0]])} (seeds: {seeds[few[0]]}), so "
                         "racing could never stop an arm there", f"list {MIN_PAIRS} or more seeds for every scale "
                         "(e.g. seeds: [0, 1, 2]), or set racing: false")
    set_decay = common["train"].get("decay_fraction") if isinstance(common.get("train"), dict) else None
    if branches is not None and set_decay is not None and set_decay != branches.decay:
        raise StudyError(f"{y}: branches.decay", f"is {branches.decay:g} and common sets "
                         f"train.decay_fraction: {set_decay}; every run decays over the branches' fraction",
                         "set the decay once, in branches.decay")
    if branches is not None and reference is not None:
        raise StudyError(f"{y}: branches", "cannot branch an experiment with a profiled reference run yet "
                         "(a scheduled run's widths come from the reference's final checkpoint)", "remove the "
                         "branches block, or split the geometry-scheduled variants into their own experiment")
    check_owned(common, f"{y}: common")
    for v in variants:
        check_owned(v.settings, f"{y}: variants.{v.name}.set")
    return Experiment(name, f["baseline"], scales, seeds, variants, reference, common, per_scale, f["description"],
                      published, tuning, decision, compares, branches, racing)


def _seeds(where: str, raw: Any, scales: list[str]) -> dict[str, list[int]]:
    """The `seeds:` block as scale -> seeds: one list for every scale, or a list per scale."""
    if raw is None:
        raise StudyError(where, "lists no seed", "e.g. seeds: [0, 1, 2]")
    if isinstance(raw, dict):
        if stray := sorted(set(map(str, raw)) - set(scales)):
            raise StudyError(where, f"names scale {stray[0]}, which is not one of the experiment's scales "
                             f"({', '.join(scales)})", f"key the seeds by {', '.join(scales)}, or add {stray[0]} to "
                             "scales")
        if missing := [s for s in scales if s not in raw]:
            raise StudyError(where, f"no seeds for scale {missing[0]}", "list seeds for every scale")
        if unlisted := [s for s in scales if not isinstance(raw[s], list)]:
            raise StudyError(where, f"the seeds of scale {unlisted[0]} are not a list",
                             f"e.g. seeds: {{{unlisted[0]}: [0, 1, 2]}}")
        seeds = {s: list(raw[s]) for s in scales}
    elif isinstance(raw, list):
        seeds = {s: list(raw) for s in scales}
    else:
        raise StudyError(where, f"must be a list or a mapping, got {type(raw).__name__}", "e.g. seeds: [0, 1, 2]")
    # YAML's true/false are Python bools, which are ints: [true, false] would plan seeds 1 and 0 under other keys
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for v in seeds.values() for x in v) or not all(
            seeds.values()):
        raise StudyError(where, "seeds must be non-empty lists of non-negative integers (true and false are not "
                         "seeds)", "e.g. seeds: [0, 1, 2]")
    if past := [x for v in seeds.values() for x in v if x > SEED_MAX]:
        raise StudyError(where, f"{past[0]} is past the largest seed torch takes", "use seeds below 2**64")
    return seeds


def _per_scale(at: Any, where: str, scales: list[str]) -> dict[str, dict[str, Any]]:
    """An `at:` block: scale name -> dotted overrides, every name a scale of the experiment, none placing a run."""
    at = at or {}  # a mapping of mappings: ExperimentFile's types checked that
    if stray := sorted(set(map(str, at)) - set(scales)):
        raise StudyError(f"{where}.{stray[0]}", "is not a scale of the experiment", f"use one of {', '.join(scales)}")
    for scale, settings in at.items():
        check_owned(settings, f"{where}.{scale}")
    return {str(k): v for k, v in at.items()}
