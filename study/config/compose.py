"""The one composer: the `sweeps/` tree plus Hydra-grammar overrides into a typed, validated `RunConfig`, for every
command and for `python -m study.train` (Hydra expands sweeps, then hands each job's overrides here). Layers, lowest
first: `sweeps/train.yaml`, the selected group files, the caller's (an experiment's identity and settings), the
overrides: `key=value` (also `+key`, `++key`: the schema is fixed, so an unknown key is an error whatever the
prefix), `~key` for the typed default, `group=option` to select a file and `~group` to drop it. Layers merge as plain
containers and are typed once, which keeps `study plan` fast for hundreds of runs."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from study.config.run import RunConfig
from study.errors import StudyError
from study.schema import NAME, check_name

GROUPS = ("scale", "model", "train", "data", "cluster")

RENAMED = {"model.ffn.cosine_start": "model.ffn.schedule.start", "model.ffn.cosine_end": "model.ffn.schedule.end",
           "geometry.anti": "model.ffn.schedule.reverse", "train.eval_interval": "train.val_interval",
           "train.eval_batches": "train.val_batches", "stage": "role"}
"""Fields renamed since key schema 3, old -> new dotted name: the old name is refused, naming the new one. Keys did
not move: study/config/identity.py hashes the schedule's fields under the names they had then."""

SCHEDULE = "model.ffn.schedule"


def refuse_renamed(node: Any, where: str) -> None:
    """StudyError naming the new name when a nested mapping (a config layer, a run spec's config) holds an old one."""
    for old in RENAMED:
        *parents, leaf = old.split(".")
        inner = functools.reduce(lambda d, p: d.get(p) if isinstance(d, dict) else None, parents, node)
        if isinstance(inner, dict) and leaf in inner:
            raise _renamed(old, where)


def _renamed(old: str, where: str) -> StudyError:
    new = RENAMED[old]
    return StudyError(old, f"was renamed to {new} (in {where})", f"write {new} instead (the run key is the same)")


def with_family(node: dict) -> dict:
    """`model.ffn.schedule: cosine` (the family alone) as `{family: cosine}`; the caller's mapping is left as it is."""
    ffn = node["model"].get("ffn") if isinstance(node.get("model"), dict) else None
    if not isinstance(ffn, dict) or not isinstance(ffn.get("schedule"), str):
        return node
    return {**node, "model": {**node["model"], "ffn": {**ffn, "schedule": {"family": ffn["schedule"]}}}}


AUTO = "auto"


def micro_batch_auto(node: dict) -> dict:
    """A layer with `train.micro_batch: auto` read as `train.micro_batch_auto: true`, the number set below kept (and
    so the global batch and run key): the planner picks the micro batch that fits. A number set above wins."""
    train = node.get("train") if isinstance(node.get("train"), dict) else {}
    if "micro_batch" not in train:
        return node
    auto = train["micro_batch"] == AUTO
    rest = {k: v for k, v in train.items() if k != "micro_batch"} if auto else train
    return {**node, "train": {**rest, "micro_batch_auto": auto or rest.get("micro_batch_auto", False)}}


def sweeps_dir() -> Path:
    """The config tree: $STUDY_SWEEPS, else the `sweeps/` folder of this checkout."""
    return Path(os.environ.get("STUDY_SWEEPS") or Path(__file__).resolve().parents[2] / "sweeps")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (sweeps_dir() / group).glob("*.yaml"))


MAX_YAML_NODES = 100_000
"""Most values a file of the tree may expand to through YAML aliases (the shipped files hold a few hundred): an alias
bomb, a few lines that expand to billions of values, is refused before OmegaConf builds it."""


def _expanded_size(node: Any) -> float:
    """Values the composed YAML node expands to, each alias counted as a copy of what it names; infinite for an alias
    inside the node it names. Linear in the file: a node named by many aliases is counted once."""
    import yaml

    sizes: dict[int, float] = {}

    def size(n) -> float:
        if id(n) in sizes:
            return sizes[id(n)]
        sizes[id(n)] = math.inf  # while its children are counted: an alias back to it is a cycle
        children = (n.value if isinstance(n, yaml.SequenceNode) else
                    [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else [])
        sizes[id(n)] = 1 + sum(size(c) for c in children)
        return sizes[id(n)]

    return 0 if node is None else size(node)


@functools.lru_cache(maxsize=None)
def _load_yaml_cached(path: Path, mtime_ns: int) -> Any:
    import yaml
    from omegaconf import OmegaConf

    try:
        # the C composer where PyYAML has it: the same node graph, a fraction of the time
        size = _expanded_size(yaml.compose(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
        loaded = OmegaConf.load(path) if size <= MAX_YAML_NODES else None
    except Exception as exc:  # a YAML syntax error is the user's, not a bug
        raise StudyError(str(path), f"cannot be read as YAML ({exc})", "fix the file's syntax") from None
    if loaded is None:
        raise StudyError(str(path), f"expands to more than {MAX_YAML_NODES:,} values through its YAML aliases "
                         "(`*name`)", "write the values out, or use fewer aliases")
    return OmegaConf.to_container(loaded)


def clear_cache() -> None:
    """Forget every parsed YAML file and composed config (benchmarks time a cold plan)."""
    _load_yaml_cached.cache_clear()
    _typed.cache_clear()


def plain_yaml(path: Path) -> Any:
    """A YAML file of the tree as plain containers (interpolations kept): a copy of the one cached until it changes."""
    path = Path(path)
    return copy.deepcopy(_load_yaml_cached(path, path.stat().st_mtime_ns))


def group_file(group: str, option: str) -> Path:
    path = sweeps_dir() / group / f"{option}.yaml"
    # one word: `data=../../elsewhere/evil` would merge any YAML file it reaches
    if not isinstance(option, str) or not NAME.match(option) or not path.is_file():
        raise StudyError(group, f"unknown option {option!r}", f"use one of {', '.join(group_options(group))}")
    return path


@dataclass
class Overrides:
    """Parsed command-line overrides."""

    groups: dict[str, str | None] = field(default_factory=dict)
    """Group selections (`scale=113M`); None drops the group (`~cluster`)."""
    values: dict[str, Any] = field(default_factory=dict)
    """Field values by dotted key."""
    reset: list[str] = field(default_factory=list)
    """Fields restored to their typed default (`~train.lr`)."""


def parse_overrides(items: list[str]) -> Overrides:
    """Hydra's override grammar into selections, values and resets; a sweep (`a,b`) is Hydra multirun's, not ours."""
    out = Overrides()
    if not items:  # Hydra's parser takes a tenth of a second to import
        return out
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(items))
    except HydraException as exc:
        bad = next((i for i in items if i in str(exc)), " ".join(items))
        raise StudyError(bad, "is not an override", "write key=value (also +key=value, ++key=value, ~key), "
                         "e.g. train.lr=3e-4 or scale=113M") from None
    for item, o in zip(items, parsed):
        key = o.key_or_group
        if o.package:
            raise StudyError(item, "sets a package", "packages (`key@pkg=...`) are not used by study's config tree")
        if o.is_sweep_override():
            raise StudyError(item, "is a sweep", "sweeps run through Hydra's multirun: "
                             "python -m study.train -m key=a,b (or list seeds/variants in an experiment file)")
        if o.type == OverrideType.DEL:
            if key in GROUPS:
                out.groups[key] = None
            else:
                out.reset.append(key)
        elif key in GROUPS:
            value = o.value()
            if not isinstance(value, str):
                raise StudyError(item, f"selects {key} option {value!r}", f"use one of {', '.join(group_options(key))}")
            out.groups[key] = value
        else:
            out.values[key] = o.value()
    return out


@functools.lru_cache(maxsize=None)
def typed_defaults():
    from omegaconf import OmegaConf

    return OmegaConf.structured(RunConfig)


def nested(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        if key == SCHEDULE and isinstance(value, str):
            key = SCHEDULE + ".family"
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise StudyError(key, "sets a field inside a value", "set the section's fields, not the value's")
        node[leaf] = value
    return out


def merge_checked(base: Any, node: Any, where: str):
    """Merge `node` onto the typed config; an unknown key or a wrong type names the field."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(base, node)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or where
        raise StudyError(str(key), f"is not valid in {where} ({str(exc).splitlines()[0]})",
                         "check the spelling and type against the typed config in study/config/") from None


_MISSING = object()


def _default_of(dotted: str) -> Any:
    from omegaconf import OmegaConf

    if dotted in RENAMED:  # refused here: the default of an old name cannot be looked up
        raise _renamed(dotted, "the `~` overrides")
    value = OmegaConf.select(typed_defaults(), dotted, default=_MISSING)
    if value is _MISSING:
        raise StudyError(f"~{dotted}", "is not a field of the run config", "check the spelling against study/config/")
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def compose(groups: dict[str, str] | None = None, layers: list[tuple[dict, str]] | None = None,
            overrides: Overrides | list[str] | None = None) -> RunConfig:
    """Defaults <- group files (`groups`, then the overrides' selections) <- `layers` <- override values."""
    from omegaconf.errors import OmegaConfBaseException

    ov = overrides if isinstance(overrides, Overrides) else parse_overrides(list(overrides or []))
    primary = plain_yaml(sweeps_dir() / "train.yaml")
    chosen: dict[str, str | None] = {
        k: v for d in primary.pop("defaults", []) if not isinstance(d, str) for k, v in d.items()}
    chosen.update({**(groups or {}), **ov.groups})
    nodes = [(primary, "train.yaml")]
    nodes += [(plain_yaml(group_file(g, chosen[g])), f"{g}/{chosen[g]}.yaml") for g in GROUPS if chosen.get(g)]
    # an ad-hoc run is named after its presets; an experiment's identity layer renames it
    nodes += [({"variant": chosen.get("model") or "conventional", "scale": chosen.get("scale") or "tiny"},
               "the selected presets"), *(layers or []), (nested(ov.values), "the command-line overrides"),
              (nested({k: _default_of(k) for k in ov.reset}), "the `~` overrides")]
    for node, where in nodes:
        refuse_renamed(node, where)
    nodes = [(micro_batch_auto(with_family(node)), where) for node, where in nodes]
    plain = functools.reduce(merge_plain, (node for node, _ in nodes), {})
    try:
        cfg = _typed(json.dumps(plain, sort_keys=True, default=str))
    except OmegaConfBaseException as exc:  # only now merge layer by layer, to name the layer and field at fault
        merged = typed_defaults()
        for node, where in nodes:
            merged = merge_checked(merged, node, where)
        raise StudyError(str(getattr(exc, "full_key", None) or "config"), f"is not valid ({str(exc).splitlines()[0]})",
                         "check the spelling and type against the typed config in study/config/") from None
    return copy.deepcopy(cfg)  # callers get their own: a cached config is never shared


def _build(cls: type, node: dict[str, Any]):
    """The dataclass `cls` from a mapping whose every value already has its field's type (an int may stand for a
    float), much faster than a typed merge; None where OmegaConf would convert or check anything, so the caller
    takes OmegaConf's path and the result never differs."""
    hints = _hints(cls)
    if not isinstance(node, dict) or any(k not in hints for k in node):
        return None
    values = {}
    for key, value in node.items():
        ok, values[key] = _value(hints[key], value)
        if not ok:
            return None
    return cls(**values)


def _value(kind: Any, value: Any) -> tuple[bool, Any]:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return type(None) in args, None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value) if len(inner) == 1 else (False, None)
    if dataclasses.is_dataclass(kind):
        built = _build(kind, value) if isinstance(value, dict) else None
        return built is not None, built
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return (True, kind(value)) if value in {m.value for m in kind} else (False, None)
    if origin is list:
        if not isinstance(value, list):
            return False, None
        items = [_value(args[0], v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        if not isinstance(value, dict) or args[0] is not str:
            return False, None
        items = {k: _value(args[1], v) for k, v in value.items()}
        return all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    if kind is float and type(value) is int:
        return True, float(value)
    if kind is str and isinstance(value, str) and "${" in value:
        return _resolved(value)
    return type(value) is kind and kind in (int, float, str, bool), value


def _resolved(value: str) -> tuple[bool, Any]:
    """A string interpolation resolved on its own (`${oc.env:NAME,default}` reads only the environment); one that
    names another field, or resolves to anything but a string, is left to OmegaConf's merge."""
    from omegaconf import OmegaConf

    try:
        out = OmegaConf.create({"value": value}).value
    except Exception:  # noqa: BLE001 - the full merge resolves it, or names what is wrong
        return False, None
    return isinstance(out, str), out


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def merge_plain(base: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """`node` over `base` as OmegaConf merges them (mappings merge key by key; anything else, lists included, is
    replaced), on plain containers: one typed merge of the result is much cheaper than one per layer."""
    return {**base, **{key: merge_plain(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict)
                       else value for key, value in node.items()}}


@functools.lru_cache(maxsize=512)
def _typed(plain_json: str) -> RunConfig:
    """The typed, validated config of merged plain layers, once per distinct content: a plan composes the same
    reference and tune-scale configs many times."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from study.config.validate import validate_run

    plain = json.loads(plain_json)
    cfg = _build(RunConfig, plain)
    # anything the direct build does not take as it is goes through OmegaConf: a merge error reaches `compose`, which
    # names the layer and the field at fault
    merged = OmegaConf.merge(typed_defaults(), plain) if cfg is None else None
    try:
        cfg = cfg or OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        if isinstance(exc.__cause__, StudyError):
            raise exc.__cause__ from None
        raise StudyError(str(getattr(exc, "full_key", "config")), f"cannot be resolved ({exc})",
                         "fix the value or the interpolation") from None
    for name in ("experiment", "variant", "scale"):  # they name directories, MLflow experiments and jobs
        check_name(name, getattr(cfg, name), f"a usable {name} name")
    validate_run(cfg)
    return cfg
