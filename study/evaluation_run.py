"""Evaluate a trained run on downstream tasks and file the scores under the same MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

from study.config import RunConfig, run_key
from study.errors import StudyError


def find_run_config(key: str, runs_root: str = "runs") -> RunConfig:
    """The resolved config a run was trained with, from its run directory (<runs>/<experiment>/<key>/config.yaml)."""
    from omegaconf import OmegaConf

    from study.config import merge_checked, typed_defaults

    found = sorted(Path(runs_root).glob(f"*/{key}/config.yaml"))
    if not found:
        raise StudyError("RUN_KEY", f"no run with key {key!r} under {Path(runs_root).resolve()}",
                         "take the key from `study plan EXPERIMENT` or `study status EXPERIMENT` (train it first)")
    node = merge_checked(typed_defaults(), OmegaConf.load(found[0]), f"{found[0]} (written by another version?)")
    return OmegaConf.to_object(node)


def load_trained_model(cfg: RunConfig, device: str = "cpu", key: str | None = None):
    """The run's model with the weights of its latest complete checkpoint."""
    from study import checkpoint
    from study.models.transformer import build_model
    from study.plan import resolve_model, run_dir

    key = key or run_key(cfg)
    ckpt = checkpoint.latest(run_dir(cfg, key))
    if ckpt is None:
        raise StudyError("RUN_KEY", f"run {key} has no complete checkpoint yet", "train it first (study train/launch)")
    model = build_model(resolve_model(cfg).model, device, seed=cfg.seed)
    checkpoint.load_model_weights(ckpt, model)
    return model.eval(), ckpt


def evaluate_run(cfg: RunConfig, tasks: list[str] | None = None, limit: int | None = None) -> dict:
    """Score the run's final checkpoint with lm-eval; metrics go to `eval/<task>/<metric>` of its MLflow run."""
    from study.data import prepare_data
    from study.evaluate import evaluate_model
    from study.plan import run_dir
    from study.tracking import Tracker

    key = run_key(cfg)
    tasks = tasks or cfg.eval.tasks
    model, ckpt = load_trained_model(cfg)
    data = prepare_data(cfg.data)
    result = evaluate_model(model, data.tokenizer_path, tasks, limit=limit or cfg.eval.limit or None,
                            batch_size=cfg.eval.batch_size, eos_token=cfg.data.eos_token)
    step = int(ckpt.name.split("_")[-1])
    out = run_dir(cfg, key) / "eval.json"
    out.write_text(json.dumps(result["lm_eval"], default=str, indent=1))
    tracker = Tracker.attach(key, cfg.experiment, cfg=cfg.tracking)
    tracker.log_metrics(result["metrics"], step)
    tracker.log_artifact(out, "eval.json")
    tracker.close()
    return result["metrics"]
