"""The run spec: one run, resolved once by the planner (config, matched widths, parameters, role, upstream runs, key),
written to `<run dir>/run.json` before anything runs, and the only thing training, evaluation and profiling build
their model from. A geometry-scheduled run's spec is pending until its reference's profile exists: its job fills in
the widths once and writes it back before training starts."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from study.config.compose import refuse_renamed
from study.config.identity import SCHEMA_VERSION
from study.config.recipe import PENDING, SCHEDULE, BranchPoint, Recipe, Tuned
from study.config.run import Role, RunConfig
from study.errors import StudyError
from study.files import (COUNT, LARGEST, NUMBER, TEXT, Kind, damaged, read_mapping, replace_file,
                         shape_problem)
from study.schema import RunDir


@dataclass(frozen=True)
class RunSpec:
    key: str
    """Run key (study/config/identity.py)."""
    name: str
    """MLflow run name, `<variant>-<scale>-s<seed>`."""
    config: RunConfig
    """The composed config; `config.model` is the matched model (every per-layer width) once resolved."""
    dir: str
    """Absolute run directory."""
    budget: int
    """Parameter budget the run is matched to."""
    params: dict[str, int] | None = None
    """Parameter breakdown (embedding, attention, ffn, norm, total, counted); None while pending."""
    mismatch: float | None = None
    """(counted - budget) / budget; None while pending."""
    flops_per_token: float | None = None
    """Training FLOPs per token of the matched model; None while pending."""
    depends_on: list[str] = field(default_factory=list)
    """Run keys that must finish first (a scheduled run's reference)."""
    profile: str = ""
    """The profile a scheduled run's widths come from (its reference's profile.json)."""
    pending: str | None = None
    """Why the widths are not known yet (the job that will produce them)."""
    reference_total: int | None = None
    """Every parameter, embeddings included, of the scale's reference model (for the mismatch of the total)."""
    recipe: Recipe | None = None
    """The resolved training recipe, the same for every arm of a comparison unless tuning chose the LR."""
    tuned: Tuned | None = None
    """The tuning the run's LR comes from (tune runs, and main runs of an experiment with `tune:`); else None."""
    points: list[BranchPoint] = field(default_factory=list)
    """Decay branches (`branches:`): a trunk's every point (it keeps a checkpoint at each start and stops at the
    last), a branch's own one."""
    trunk: str | None = None
    """A branch's trunk: the run key whose checkpoint at `points[0].start` it starts from."""
    schema: int = SCHEMA_VERSION
    """Key and spec schema version."""

    @property
    def model(self):
        return self.config.model

    @property
    def role(self) -> Role:
        return self.config.role

    @property
    def run_dir(self) -> RunDir:
        return RunDir(self.dir)

    @property
    def counted(self) -> int:
        if self.params is None:
            raise StudyError("run spec", f"run {self.key} has no resolved widths yet ({self.pending})",
                             "let the jobs it waits on finish first (study launch chains them)")
        return self.params["counted"]

    @property
    def mismatch_total(self) -> float | None:
        """(total - reference total) / reference total: what matching the non-embedding budget leaves in the
        embeddings."""
        if self.params is None or not self.reference_total:
            return None
        return (self.params["total"] - self.reference_total) / self.reference_total

    @property
    def first_step(self) -> int:
        """The step training starts from: a branch's trunk step, else 0."""
        return self.points[0].start if self.role == Role.branch else 0

    @property
    def last_step(self) -> int:
        """The step training ends at: a trunk's last branch start (its recipe is the longest branch's, so its LR
        stays stable up to there), else the recipe's max_steps."""
        return self.points[-1].start if self.role == Role.trunk else self.planned.max_steps

    @property
    def kept_steps(self) -> frozenset[int]:
        """Checkpoint steps never pruned: a trunk's branch starts (its branches start from them)."""
        return frozenset(p.start for p in self.points) if self.role == Role.trunk else frozenset()

    def tokens(self) -> int:
        """Tokens this run trains itself (a branch: from its trunk step on; a trunk: up to its last branch)."""
        r = self.planned
        if self.role in (Role.trunk, Role.branch):
            return (self.last_step - self.first_step) * r.tokens // max(1, r.max_steps)
        return r.tokens

    @property
    def awaits_tuning(self) -> bool:
        """A main run whose LR waits for its variant's tune runs."""
        return self.tuned is not None and self.tuned.status == PENDING

    @property
    def planned(self) -> Recipe:
        if self.recipe is None:
            raise StudyError("run spec", f"run {self.key} has no resolved recipe",
                             "plan and launch the run again (study launch EXPERIMENT) to rewrite its spec")
        return self.recipe

    def gpu_hours(self) -> float | None:
        """Estimated GPU-hours at the assumed MFU (an estimate: never part of the key)."""
        if self.flops_per_token is None:
            return None
        t = self.config.train
        return self.tokens() * self.flops_per_token / (t.gpu_peak_tflops * 1e12 * t.assumed_mfu) / 3600

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def shown(self, tracking_uri: str) -> dict[str, Any]:
        """The spec as `study train --cfg job` prints it, masked: the values the run will use where a field's 0, empty
        or None stands for a default (model fields, seeds), and `tracking_uri`, the store it will log to. run.json
        keeps the fields as written: the run key hashes them so."""
        from study.config.secrets import redact

        out = json.loads(json.dumps(self.as_dict(), default=str))  # plain data, as run.json holds it (a role by name)
        cfg, model = self.config, self.config.model
        out["config"]["model"].update(n_kv_heads=model.kv_heads, head_dim=model.dim_head, norm_eps=model.eps,
                                      rope_theta=model.theta, init=model.init_rule, qk_norm=model.has_qk_norm)
        out["config"].update(init_seed=cfg.weights_seed, data_seed=cfg.order_seed)
        out["config"]["tracking"]["uri"] = tracking_uri
        return redact(out)


def held_spec(spec: RunSpec) -> RunSpec | None:
    """The spec the run's directory already holds (None when none), refusing another run's (a run directory belongs
    to one run key for good) and naming one of another schema version, never overwritten."""
    path = spec.run_dir.spec
    if not path.is_file():
        return None
    held = read_spec(path)
    if held.key != spec.key:
        raise StudyError("paths.runs", f"{spec.run_dir.path} holds run {held.key}, not {spec.key}",
                         "leave run directories as the launcher made them; move the foreign run.json away")
    return held


def write_spec(spec: RunSpec) -> Path:
    """Write the spec, masked, whole into its run directory (a job never reads a half-written spec)."""
    from study.config.secrets import redact

    path = spec.run_dir.spec
    what = f"create the run directory {path.parent}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        what = f"write the run spec {path}"
        replace_file(path, json.dumps(redact(spec.as_dict()), indent=1, default=str))
    except OSError as err:
        raise StudyError("paths.runs", f"cannot {what} ({os.strerror(err.errno or 0)})",
                         "point paths.runs at a writable directory (shared between nodes on a cluster)") from None
    return path


def read_spec(path: Path | str) -> RunSpec:
    """The spec at `path` (a run.json, or a run directory holding one), checked against this version's schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = RunDir(path).spec if Path(path).is_dir() else Path(path)
    if not path.exists() and not path.is_symlink():  # nothing to repair: the fix is another path
        raise StudyError("run spec", f"{path} does not exist",
                         "give the run.json a launch wrote (<paths.runs>/<experiment>/<run key>/run.json) or its run "
                         "directory")
    rewrite = f"delete {path}: the next `study launch EXPERIMENT` writes the run's spec again from its plan (its " \
              "checkpoints stay)"
    raw = read_mapping(path, {}, rewrite)
    if (found := raw.get("schema")) != SCHEMA_VERSION:
        raise StudyError("run spec", f"{path} was written by key schema {found}, this version uses {SCHEMA_VERSION}",
                         "relaunch the experiment with this version (new run keys), or use the version that wrote it")
    refuse_renamed(raw.get("config"), str(path))
    try:
        node = OmegaConf.merge(OmegaConf.structured(RunSpec), raw)
        if isinstance(raw.get("recipe"), dict):
            # a spec written before its recipe carried the schedule trained on its config's
            node = OmegaConf.merge(node, {"recipe": {name: node.config.train[name] for name in SCHEDULE
                                                     if name not in raw["recipe"]}})
        spec = OmegaConf.to_object(node)
    except OmegaConfBaseException as exc:
        raise StudyError("run spec", f"{path} does not match this version's run spec ({str(exc).splitlines()[0]})",
                         "relaunch the experiment with this version") from None
    _check_values(spec, path, rewrite)
    return spec


def _check_values(spec: RunSpec, path: Path, rewrite: str) -> None:
    """A spec's values held to what a plan of them would be (a hand edit of run.json): refused naming the file and
    the field, where training would otherwise fail deep inside, or ignore the value."""
    from study.config.geometry import one_of
    from study.config.training import TrainConfig
    from study.config.validate import validate_run

    try:
        validate_run(spec.config)
        if spec.recipe is not None:
            one_of("recipe.lr_schedule", spec.recipe.lr_schedule,
                   TrainConfig.__dataclass_fields__["lr_schedule"].metadata["choices"])
    except StudyError as err:
        named = err.field if err.field.startswith("recipe.") else f"config.{err.field}"
        raise StudyError(str(path), f"has `{named}`: {err.problem}",
                         f"{err.fix} (in that file), or {rewrite}") from None


DIVERGED = "diverged"
"""result.json's field saying why a tune run's loss went non-finite: the run is settled, its loss the worst there is."""
LOSS = Kind(f"a finite loss from 0 to {LARGEST:g}", lambda v: NUMBER.holds(v) and v >= 0)


def read_result(path: Path, key: str) -> dict | None:
    """The result.json at `path` the trainer wrote when run `key` finished (final `step`, `val_loss`, or why a tune run
    diverged); None until then, and for another run key's. Refused by name when damaged."""
    if not path.exists() and not path.is_symlink():
        return None
    fix = (f"delete {path}: the run's next start (`study launch EXPERIMENT`, or `study train`) finishes it again from "
           "its last checkpoint and writes it again")
    result = read_mapping(path, {"run_key": TEXT, "step": COUNT}, fix)
    if result["run_key"] != key:
        return None
    if problem := shape_problem(result, {DIVERGED: TEXT} if result.get(DIVERGED) else {"val_loss": LOSS}):
        raise damaged(path, problem, fix)
    return result


def finished_result(spec: RunSpec) -> dict | None:
    """What the trainer wrote to the run directory's result.json when training finished (`read_result`)."""
    return read_result(spec.run_dir.result, spec.key)


def finished_loss(spec: RunSpec) -> float | None:
    """A finished run's final validation loss (None until it finished; inf for a tune run that diverged)."""
    result = finished_result(spec)
    if result is None:
        return None
    return math.inf if result.get(DIVERGED) else float(result["val_loss"])


def diverged(spec: RunSpec) -> str | None:
    """Why a settled tune run diverged (None when it did not, or has not settled)."""
    result = finished_result(spec)
    return str(result[DIVERGED]) if result is not None and result.get(DIVERGED) else None
