"""What the arms of a comparison share: a variant may change only what the experiment compares.

Every arm at a scale trains on the same data, order, init rule and seeds, with one recipe and one budget; the arms
differ in their model. A variant's setting of a shared field is refused, naming it, unless the experiment declares
the comparison is about it (`compares: [train.lr]`; the report then says so). The fields that place a run are the
experiment file's alone.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from study.config.identity import KEY, placement
from study.config.run import RunConfig, leaves
from study.errors import StudyError

OWNED = ("experiment", "variant", "scale", "seed", "baseline", "role")
"""Fields an experiment file sets for each of its runs: a variant, `common` or `at:` never does."""

SHARED_PREFIXES = ("init_seed", "data_seed", "data.", "train.", "budget.mode", "budget.target", "model.init",
                   "model.vocab_size")
"""Hashed fields every arm of a scale shares: seeds, data, recipe, budget and init rule (`budget.match`, the dimension
an arm solves, is part of its model)."""

ALSO_SHARED = ("train.val_batches",)
"""Unhashed fields the arms share all the same: the validation windows every arm is scored on."""


def shared(dotted: str) -> bool:
    """Whether the arms of a comparison must agree on a config field."""
    return dotted in ALSO_SHARED or (dotted.startswith(SHARED_PREFIXES) and placement(dotted)[0] == KEY)


def check_owned(settings: dict[str, Any], where: str) -> None:
    """A block of dotted settings (`set:`, `at:`, `common`) that sets a field the experiment file owns per run."""
    for key in settings:
        if str(key).split(".")[0] in OWNED:
            raise StudyError(f"{where}.{key}", "places a run (experiment, variant, scale, seed, baseline and role "
                             "are the experiment file's: the run would land in another experiment, name or pairing)",
                             "remove it: name variants under `variants:`, scales under `scales:`, seeds under "
                             "`seeds:`")


def check_arms(experiment: str, scale: str, baseline: str, arms: dict[str, RunConfig],
               compares: tuple[str, ...]) -> None:
    """Every arm at one scale agrees with the baseline on each shared field the experiment does not compare."""
    base = leaves(asdict(arms[baseline]))
    for name, cfg in arms.items():
        unshared = [(dotted, value) for dotted, value in leaves(asdict(cfg)).items()
                    if value != base.get(dotted) and shared(dotted) and not declared(dotted, compares)]
        if name == baseline or not unshared:
            continue
        dotted, value = unshared[0]
        raise StudyError(f"{experiment}.yaml: variants.{name}", f"sets {dotted}={value!r} at scale {scale}, where the "
                         f"baseline {baseline} has {base.get(dotted)!r}: the arms of a comparison share their data, "
                         "seeds, recipe, budget and init rule, so its runs would be paired as matched while they are "
                         "not", f"set {dotted} in `common` (every arm), or, if the comparison is about it, declare it "
                         f"in the experiment file: `compares: [{dotted}]` (the report then says the arms differ in it)")


def declared(dotted: str, compares: tuple[str, ...]) -> bool:
    """Whether a field is among the experiment's declared differences (a section names every field in it)."""
    return any(dotted == c or dotted.startswith(c + ".") for c in compares)


def check_compares(raw: Any, where: str) -> tuple[str, ...]:
    """The `compares:` block: a list of shared fields the arms differ in on purpose."""
    if not isinstance(raw, list) or not raw or any(not isinstance(f, str) for f in raw):
        raise StudyError(where, f"{raw!r} is not a list of config fields", "write e.g. `compares: [train.lr]`")
    for field in raw:
        if field.split(".")[0] in OWNED:
            raise StudyError(where, f"{field} places a run and cannot differ between arms",
                             "compare recipe, data or init fields only")
        try:
            known = shared(field) or any(shared(d) for d in leaves(asdict(RunConfig())) if declared(d, (field,)))
        except KeyError:
            known = False
        if not known:
            raise StudyError(where, f"{field} is not a field the arms share",
                             "name a shared field (data.*, train.*, budget.mode/target, model.init*, init_seed, "
                             "data_seed); model fields already differ freely between arms")
    return tuple(raw)
