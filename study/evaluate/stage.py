"""Evaluate a trained run on downstream tasks and file the scores under the same MLflow run."""

from __future__ import annotations

import json
import re
from pathlib import Path

from study.config.spec import RunSpec, read_spec
from study.errors import StudyError
from study.schema import ITEMS_ARTIFACT
from study.train import checkpoint


def find_run(key: str, runs_root: str = "runs") -> RunSpec:
    """The spec of the run with this key, from its run directory (<runs>/<experiment>/<key>/run.json)."""
    if not re.fullmatch(r"[0-9a-f]{12}", key):
        raise StudyError("RUN_KEY", f"{key!r} is not a run key (12 hexadecimal characters)",
                         "take the key from `study plan EXPERIMENT` or `study status EXPERIMENT`")
    found = sorted(Path(runs_root).glob(f"*/{key}/run.json"))
    if not found:
        raise StudyError("RUN_KEY", f"no run with key {key!r} under {Path(runs_root).resolve()}",
                         "take the key from `study plan EXPERIMENT` or `study status EXPERIMENT` (launch it first)")
    spec = read_spec(found[0])
    if spec.key != key:
        raise StudyError("RUN_KEY", f"{found[0]} holds the spec of run {spec.key}, not {key}",
                         "a run directory holds its own run.json only: relaunch the experiment to rewrite it")
    return spec


def load_trained_model(spec: RunSpec, device: str = "cpu"):
    """The run's model (built from its spec) with the weights of its latest complete checkpoint."""
    from study.models.transformer import build_model

    ckpt = checkpoint.latest(spec.run_dir.path)
    if ckpt is None:
        raise StudyError("RUN_KEY", f"run {spec.key} has no complete checkpoint yet", "train it first (study train/launch)")
    if spec.pending is not None:
        raise StudyError("RUN_KEY", f"run {spec.key}'s spec is still pending ({spec.pending})",
                         "let its job complete the spec and train it first")
    model = build_model(spec.model, device, seed=spec.config.seed)
    checkpoint.load_model_weights(ckpt, model)
    return model.eval(), ckpt


def run_tokenizer(spec: RunSpec) -> Path:
    """The tokenizer the run was trained with: its run directory's copy, else (a run trained before runs kept one)
    the one beside its shards in the cache; never tokenises anything."""
    if spec.run_dir.tokenizer.is_file():
        return spec.run_dir.tokenizer
    from study.data.shards import find_shards

    entry = find_shards(spec.config.data)
    if entry is None:
        raise StudyError("RUN_KEY", f"run {spec.key} has no tokenizer.json in {spec.run_dir.path} and its token "
                         "shards are not in the data cache", "point data.cache_dir (or $STUDY_CACHE) at the cache "
                         "it was trained from, or copy its tokenizer.json into the run directory")
    return entry / "tokenizer.json"


def evaluate_run(spec: RunSpec, tasks: list[str] | None = None, limit: int | None = None) -> dict:
    """Score the run's final checkpoint with lm-eval; metrics go to `eval/<task>/<metric>` of its MLflow run."""
    from study.evaluate.harness import evaluate_model
    from study.track.tracker import Tracker

    cfg = spec.config
    tasks = tasks or cfg.eval.tasks
    model, ckpt = load_trained_model(spec)
    result = evaluate_model(model, run_tokenizer(spec), tasks, limit=limit or cfg.eval.limit or None,
                            batch_size=cfg.eval.batch_size, eos_token=cfg.data.eos_token)
    step = int(ckpt.name.split("_")[-1])
    record = write_record(spec, tasks, limit or cfg.eval.limit or None, step, result)
    tracker = Tracker.attach(spec.key, cfg.experiment, cfg=cfg.tracking)
    tracker.log_metrics(result["metrics"], step)  # another evaluation at this step is another point, never dropped
    tracker.log_artifact(record, f"evals/{record.name}")
    tracker.log_artifact(spec.run_dir.eval, "eval.json")
    tracker.log_artifact(record.with_suffix(".items.jsonl"), ITEMS_ARTIFACT)
    tracker.close()
    return result["metrics"]


def write_record(spec: RunSpec, tasks: list[str], limit: int | None, step: int, result: dict) -> Path:
    """One evaluation as its own record, `evals/step<N>-<settings hash>.json`, never replacing another with other
    settings; `eval.json` holds the latest evaluation's full lm-eval output."""
    import hashlib
    import os
    import time

    settings = {"tasks": sorted(tasks), "limit": limit, "step": step}
    name = f"step{step:08d}-{hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:8]}.json"
    folder = spec.run_dir.evals
    folder.mkdir(parents=True, exist_ok=True)
    record = {**settings, "run_key": spec.key, "checkpoint": f"step_{step:08d}", "time": time.time(),
              "metrics": result["metrics"]}
    path = folder / name
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)
    spec.run_dir.eval.write_text(json.dumps(result["lm_eval"], default=str, indent=1))
    lines = [json.dumps({"task": task, **row}) for task, rows in result.get("items", {}).items() for row in rows]
    path.with_suffix(".items.jsonl").write_text("".join(line + "\n" for line in lines))
    return path


def evaluated(spec: RunSpec) -> bool:
    """Whether the run has an evaluation record of its final checkpoint with its configured tasks."""
    folder = spec.run_dir.evals
    if not folder.is_dir():
        return False
    for path in folder.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if set(record.get("tasks", [])) >= set(spec.config.eval.tasks):
            return True
    return False
