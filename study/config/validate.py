"""The checks of a composed run config, in one place: the composer runs them for every run it builds, so an experiment
with a bad setting plans, writes and submits nothing. (Model shapes are checked by the budget matcher, the geometry
section by its own `__post_init__`.)"""

from __future__ import annotations

from study.config.data import validate_data
from study.config.run import RunConfig
from study.errors import StudyError

CHOICES = {
    "train.lr_schedule": ("cosine", "wsd"),
    "train.precision": ("auto", "fp32", "bf16"),
    "train.device": ("auto", "cpu", "cuda"),
    "stage": ("train", "reference", "scheduled"),
}
POSITIVE = ("train.micro_batch", "train.grad_accum", "train.eval_interval", "train.eval_batches",
            "train.ckpt_interval", "train.keep_last", "train.log_interval", "eval.batch_size",
            "cluster.nodes", "cluster.tasks_per_node", "cluster.cpus_per_task", "cluster.time_min",
            "cluster.array_parallelism", "tracking.batch_points")
NON_NEGATIVE = ("seed", "train.max_steps", "train.lr", "train.warmup_steps", "train.weight_decay", "train.grad_clip",
                "train.z_loss", "train.global_batch", "cluster.gpus_per_node", "cluster.max_requeues",
                "cluster.signal_delay_s", "cluster.mem_gb", "eval.limit")


def _get(cfg: RunConfig, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate_run(cfg: RunConfig) -> None:
    for name, allowed in CHOICES.items():
        if _get(cfg, name) not in allowed:
            raise StudyError(name, f"unknown value {_get(cfg, name)!r}", f"use one of {', '.join(allowed)}")
    for name in POSITIVE:
        if _get(cfg, name) <= 0:
            raise StudyError(name, f"must be positive, got {_get(cfg, name)}", "use a value >= 1")
    for name in NON_NEGATIVE:
        if _get(cfg, name) < 0:
            raise StudyError(name, f"cannot be negative, got {_get(cfg, name)}", "use a value >= 0")
    t = cfg.train
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise StudyError("train.min_lr_ratio", f"{t.min_lr_ratio} is outside [0, 1]", "use e.g. 0.1")
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
    validate_data(cfg.data, files=False)
    if cfg.cluster.signal_delay_s >= cfg.cluster.time_min * 60:
        raise StudyError("cluster.signal_delay_s", f"the USR2 warning ({cfg.cluster.signal_delay_s} s) comes before "
                         f"the job even starts (time limit {cfg.cluster.time_min} min)",
                         "use a lead well under the time limit, e.g. 120 s for a 60-minute job")
