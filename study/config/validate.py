"""The checks of a composed run config, run by the composer for every run it builds, so a bad setting plans nothing
(model shapes: the budget matcher; the geometry section: its `__post_init__`; data files: `validate_data`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

from study.config.cluster import ClusterConfig
from study.config.data import validate_data
from study.config.geometry import one_of
from study.config.recipe import batch_layout
from study.config.run import RunConfig, leaves
from study.console import hidden_character
from study.errors import StudyError

SEED_MAX = 2**64 - 1
"""The largest seed (a run's, an experiment's `seeds:`, a tuning's `tune.seeds`): torch's generators take 64 bits."""
URI_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")
# one word SLURM understands: letters, digits and the punctuation of partition lists and constraint expressions
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:+=@%&|()\[\]*!-]*$")


def is_number(value: Any) -> bool:
    """A finite int or float, never a bool (YAML's true and false are Python ints)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def refuse_unknown(raw: dict, allowed, where: str, what: str, fix: str) -> None:
    """Refuse the first key of block `raw` (at `where`) outside `allowed`, as not `what`."""
    if unknown := sorted(set(raw) - set(allowed)):
        raise StudyError(f"{where}.{unknown[0]}", f"is not {what}", fix)


def _declared(node: Any, prefix: str = "") -> list[tuple[str, Mapping[str, Any], Any]]:
    """(dotted name, checks, value) of every field whose metadata declares checks: `choices`, `positive`,
    `non_negative`, `at_most` (MLflow takes at most 1,000 metrics per batch; an MFU is a fraction)."""
    out = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            out += _declared(value, f"{prefix}{f.name}.")
        elif f.metadata:
            out.append((prefix + f.name, f.metadata, value))
    return out


def _check_values(cfg: RunConfig) -> None:
    """Strings reach sbatch scripts, file names and shell lines: no control characters anywhere (a newline in a
    cluster setting would be a shell line of its own). Numbers must be finite."""
    for dotted, value in leaves(cfg, into_lists=True).items():
        if isinstance(value, str) and (hidden := hidden_character(value)):
            # a right-to-left override or a zero-width space shows one command and runs another
            raise StudyError(dotted, f"contains a control or format character ('{hidden}')",
                             "write the value on one line, without tabs, newlines, escape characters or invisible "
                             "formatting (right-to-left overrides, zero-width spaces)")
        if isinstance(value, float) and not math.isfinite(value):
            raise StudyError(dotted, f"must be a finite number, got {value}", "use a finite value")


def _check_cluster(cfg: RunConfig) -> None:
    c = cfg.cluster
    for name in ("name", "partition", "account", "qos", "constraint", "prepare_partition"):
        if not SLURM_WORD.match(getattr(c, name)):
            raise StudyError(f"cluster.{name}", f"{getattr(c, name)!r} is not one SLURM word",
                             "use letters, digits and , . _ - (spaces, quotes and shell characters are refused)")
    if c.signal_delay_s >= c.time_min * 60:
        raise StudyError("cluster.signal_delay_s", f"the USR2 warning ({c.signal_delay_s} s) comes before "
                         f"the job even starts (time limit {c.time_min} min)",
                         "use a lead well under the time limit, e.g. 120 s for a 60-minute job")
    t = cfg.train
    global_batch = t.global_batch or t.micro_batch * t.grad_accum
    if c.ranks > global_batch or (global_batch % c.ranks and not t.global_batch):
        _refuse_layout(c, global_batch, "train.global_batch" if t.global_batch else
                       f"train.micro_batch {t.micro_batch} x train.grad_accum {t.grad_accum}")
    batch_layout(global_batch, t.micro_batch, c.ranks)


def _refuse_layout(c: ClusterConfig, global_batch: int, source: str) -> None:
    """Refuse a cluster layout that cannot split a step's sequences (more ranks than sequences, or a derived batch
    they do not divide), naming the layout field that multiplies the ranks and a value that fits: the batch is the
    run's key, the layout only this launch's."""
    per_node = c.gpus_per_node or c.tasks_per_node
    per_node_field = "cluster.gpus_per_node" if c.gpus_per_node else "cluster.tasks_per_node"
    field, current, scale = ("cluster.nodes", c.nodes, per_node) if c.nodes > 1 else (per_node_field, per_node, 1)
    fits = next((v for v in range(min(current - 1, global_batch // scale), 0, -1) if global_batch % (v * scale) == 0),
                None)
    unit = ("GPU" if c.gpus_per_node else "task") + ("s" if per_node > 1 else "")
    layout = f"{c.nodes} nodes x {per_node} {unit} per node" if c.nodes > 1 else f"{per_node} {unit} on one node"
    raise StudyError(field, f"{layout} make {c.ranks} ranks, and a step's {global_batch} sequences ({source}) "
                     + ("cannot give each rank one" if c.ranks > global_batch else "do not split evenly over them"),
                     f"use a layout whose ranks divide {global_batch}" + (f", e.g. {field}={fits}" if fits else "")
                     + f", or set train.global_batch to a multiple of {c.ranks}")


def _check_tracking(cfg: RunConfig) -> None:
    uri = cfg.tracking.uri
    if not uri:
        return
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else "file"
    if scheme not in URI_SCHEMES:
        raise StudyError("tracking.uri", f"scheme {scheme!r} is not a tracking store MLflow can open",
                         f"use one of {', '.join(s + '://' for s in URI_SCHEMES)} (or leave it empty)")
    # a password, or over HTTP a userinfo alone (`https://TOKEN@host`): jobs read the config masked
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/@]*:[^/@]*@|^https?://[^/@]+@", uri):
        raise StudyError("tracking.uri", "holds a password or token, which would be written to every run's config",
                         "put credentials in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                         "MLFLOW_TRACKING_TOKEN) instead")


def validate_run(cfg: RunConfig) -> None:
    from study.config.tasks import check_tasks

    _check_values(cfg)
    if not cfg.eval.tasks:
        raise StudyError("eval.tasks", "no task given", "name at least one task, e.g. [arc_easy_local]")
    check_tasks(cfg.eval.tasks, field="eval.tasks", index=False)  # lm-eval's names are checked where a run launches
    declared = _declared(cfg)
    for name, meta, value in declared:
        if "choices" in meta:
            one_of(name, value, meta["choices"])
    for name, meta, value in declared:
        if meta.get("positive") and value <= 0:
            raise StudyError(name, f"must be positive, got {value}", "use a value > 0")
        if meta.get("non_negative") and value < 0:
            raise StudyError(name, f"cannot be negative, got {value}", "use a value >= 0")
    for name in ("init_seed", "data_seed"):
        if (value := getattr(cfg, name)) is not None and value < 0:
            raise StudyError(name, f"cannot be negative, got {value}", "use a value >= 0, or null for `seed`")
    for name in ("seed", "init_seed", "data_seed"):
        if (value := getattr(cfg, name)) is not None and value > SEED_MAX:
            raise StudyError(name, f"{value} is past the largest seed torch takes", "use a seed below 2**64")
    for name, meta, value in declared:
        if "at_most" in meta and value > (bound := meta["at_most"]):
            raise StudyError(name, f"must be at most {bound}, got {value}", f"use a value <= {bound}")
    t = cfg.train
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise StudyError("train.min_lr_ratio", f"{t.min_lr_ratio} is outside [0, 1]", "use e.g. 0.1")
    if t.lr and t.final_lr > t.lr:
        raise StudyError("train.final_lr", f"{t.final_lr} is above the peak train.lr {t.lr}",
                         "use a final LR at or below the peak (the hourglass release: 6e-5)")
    if not (0.0 <= t.beta1 < 1.0 and 0.0 <= t.beta2 < 1.0):
        raise StudyError("train.beta1", "AdamW betas must lie in [0, 1)", "use e.g. beta1=0.9 beta2=0.95")
    if not 0.0 < t.decay_fraction <= 1.0:
        raise StudyError("train.decay_fraction", f"{t.decay_fraction} is outside (0, 1]", "use e.g. 0.2")
    if t.max_steps == 0 and t.tokens_per_param <= 0:
        raise StudyError("train.tokens_per_param", "no step budget: max_steps is 0 and tokens_per_param <= 0",
                         "set train.max_steps or a positive train.tokens_per_param (e.g. 20)")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise StudyError("data.seq_len", f"{cfg.data.seq_len} exceeds model.max_seq_len {cfg.model.max_seq_len}",
                         "raise model.max_seq_len or lower data.seq_len")
    if cfg.model.vocab_size < cfg.data.vocab_size and cfg.data.tokenizer == "bpe":
        raise StudyError("model.vocab_size", f"{cfg.model.vocab_size} rows cannot embed the BPE's "
                         f"{cfg.data.vocab_size} ids", f"set model.vocab_size >= {cfg.data.vocab_size}")
    validate_data(cfg.data, files=False)
    _check_cluster(cfg)
    _check_tracking(cfg)
