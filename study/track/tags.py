"""The MLflow tags of a training run (names in study.schema), from its spec and the SLURM environment."""

from __future__ import annotations

import os

from study import schema
from study.config.identity import SCHEMA_VERSION
from study.config.run import Role
from study.config.spec import RunSpec


def run_tags(spec: RunSpec) -> dict[str, str]:
    """The run's study.schema tags; the SLURM job id when the run is a SLURM job."""
    cfg = spec.config
    tags = {schema.TAG_RUN_KEY: spec.key, schema.TAG_EXPERIMENT: cfg.experiment, schema.TAG_VARIANT: cfg.variant,
            schema.TAG_SCALE: cfg.scale, schema.TAG_SEED: str(cfg.seed), schema.TAG_ROLE: cfg.role,
            schema.TAG_BASELINE: cfg.baseline, schema.TAG_KEY_SCHEMA: str(SCHEMA_VERSION)}
    tags[schema.TAG_LR_SOURCE] = "tune" if spec.tuned is not None else "recipe"
    if spec.tuned is not None:
        tags[schema.TAG_TUNE_MULTIPLE] = f"{spec.tuned.multiple:g}"
        if cfg.role != Role.tune:
            tags[schema.TAG_TUNE_STATUS] = spec.tuned.status
    if cfg.role == Role.branch:
        point = spec.points[0]
        tags |= {schema.TAG_TRUNK_KEY: str(spec.trunk), schema.TAG_BRANCH_STEP: str(point.start),
                 schema.TAG_BRANCH_AT: f"{point.at:g}"}
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    # `<array job>_<task>` for an array task (as squeue shows it), the job id otherwise
    if job := f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID"):
        tags[schema.TAG_SLURM_JOB] = job
        tags[schema.TAG_SLURM_RESTARTS] = os.environ.get("SLURM_RESTART_COUNT", "0")
    return tags
