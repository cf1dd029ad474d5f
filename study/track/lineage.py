"""Where a run came from, in MLflow's own terms, computed once at open: the code (source and git commit tags), a
one-line description (the run page's box), and the token shards it trained on (a dataset input); and the run's own
study.schema tags, from its spec and the SLURM environment."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from study import installed_version, schema
from study.config.identity import SCHEMA_VERSION, json_digest
from study.config.run import Role
from study.config.spec import RunSpec

# MLflow's own tag names (mlflow.utils.mlflow_tags); the UI renders them on the run page
SOURCE_NAME, SOURCE_TYPE = "mlflow.source.name", "mlflow.source.type"
GIT_COMMIT, GIT_REPO = "mlflow.source.git.commit", "mlflow.source.git.repoURL"
DESCRIPTION = "mlflow.note.content"
PARENT = "mlflow.parentRunId"
DATASET_CONTEXT = "mlflow.data.context"
DIGEST_CHARS = 32
"""MLflow stores a dataset digest in 36 characters."""


@functools.cache
def _checkout() -> tuple[str | None, bool, str | None]:
    """(commit, dirty, remote URL) of the git checkout `study` is imported from; (None, False, None) outside one."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, False, None
    # tracked files only: run directories, caches and stores inside a checkout are not code changes
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return commit, dirty, git("remote", "get-url", "origin")


def source_tags() -> dict[str, str]:
    """MLflow's source tags for `study train`: the package version, and in a checkout the git commit, remote and
    `study.git_dirty` (tracked files differ from it)."""
    tags = {SOURCE_NAME: "study train", SOURCE_TYPE: "JOB", "study.version": installed_version()}
    commit, dirty, remote = _checkout()
    if commit is not None:
        tags[GIT_COMMIT] = commit
        tags["study.git_dirty"] = str(dirty).lower()
    if remote:
        tags[GIT_REPO] = remote
    return tags


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


def description(spec: RunSpec) -> str:
    """One line for the run page: variant, scale and seed, the shape, and the budget it is matched to."""
    cfg, m = spec.config, spec.model
    ffn = m.ffn
    widths = ffn.widths or []
    if ffn.kind == "hourglass":
        sub = sorted({w // max(ffn.k, 1) for w in widths}) or [ffn.width]
        body = f"hourglass FFN K={ffn.k} d_h={_span(sub)}"
    else:
        body = f"SwiGLU FFN d_ff={_span(sorted(set(widths)) or [ffn.width])}"
    schedule = ffn.schedule
    if len(set(widths)) > 1:
        body += f" ({'reversed ' if schedule.reverse else ''}{schedule.family} schedule)"
    heads = sorted({m.q_heads(layer) for layer in range(m.n_layers)})
    line = (f"{cfg.variant} at {cfg.scale}, seed {cfg.seed}: {m.block} L{m.n_layers} d_model={m.d_model} "
            f"heads={_span(heads)}, {body}")
    if spec.params and spec.budget:
        line += f"; {spec.counted / 1e6:,.2f}M parameters counted against a {spec.budget / 1e6:,.2f}M budget"
        if spec.mismatch is not None:
            line += f" ({spec.mismatch:+.1e})"
    return line


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def dataset_input(data, data_cfg) -> Any:
    """The run's token shards as an MLflow `DatasetInput` (context `training`): the corpus's name, a digest of the
    shards' checksums, token and document counts as its profile."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    meta = data.meta
    sums = meta.get("sha256") or {}
    digest = json_digest(sums, DIGEST_CHARS)
    name = data_cfg.name if not data_cfg.config_name else f"{data_cfg.name}:{data_cfg.config_name}"
    flat = bool(data_cfg.tokens)  # pre-tokenised files read in place: they are the source
    local = flat or Path(data_cfg.name).expanduser().exists()
    source = ({"tokens": list(data_cfg.tokens), "val_tokens": list(data_cfg.val_tokens or [])} if flat else
              {"uri": str(Path(data_cfg.name).expanduser().resolve()) if local else data_cfg.name})
    source["shards"] = str(data.shard_dir)
    splits = meta.get("splits", {})
    profile = {f"{split}_{what}": stats[what] for split, stats in splits.items() for what in ("tokens", "documents")
               if what in stats}
    profile.update({"vocab_size": meta.get("vocab_size"), "dtype": meta.get("dtype")})
    dataset = Dataset(name=name[:500], digest=digest, source_type="local" if local or data_cfg.name == "docstrings"
                      else "hugging_face", source=json.dumps(source), profile=json.dumps(profile))
    return DatasetInput(dataset=dataset, tags=[InputTag(key=DATASET_CONTEXT, value="training")])
