"""Evaluate a trained run on downstream tasks and file the scores under the same MLflow run.

Each evaluation is its own record (study.eval.records): a folder in the run directory and among the MLflow run's
artifacts, and metric points at the checkpoint's step, `eval/<task>/<metric>` for the evaluation of record and
`evals/<id>/<task>/<metric>` for any other. MLflow cannot delete a point, so a repeated evaluation logs only the
scores the run does not hold at that step: an equal score adds nothing, a different one (another device) adds a
newer point at the same step, the value MLflow's latest metric and the report read.
"""

from __future__ import annotations

import json
import time

from study.config.spec import RunSpec
from study.errors import StudyError
from study.eval.records import is_of_record, settings_for, write_record
from study.schema import EVAL_RECORD, TAG_EVAL, eval_artifact


def evaluate_run(spec: RunSpec, tasks: list[str] | None = None, limit: int | None = None,
                 num_fewshot: int | None = None) -> dict:
    """Score the run's latest checkpoint with lm-eval and record it (files first, then MLflow); returns the record.
    `limit` (0: every document) and `num_fewshot` default to the run's `eval` config, `tasks` to `eval.tasks`."""
    from study.config.tasks import check_tasks
    from study.eval.harness import evaluate_model, task_summary
    from study.eval.hub import check_hub_data
    from study.eval.locate import open_trained, run_eos_token
    from study.track.tracker import Tracker

    cfg = spec.config
    names = list(tasks or cfg.eval.tasks)
    check_hub_data(check_tasks(names, index=False))  # before the checkpoint loads: offline, hub data may be missing
    run = open_trained(spec)
    settings = settings_for(spec, names, run.step, limit, num_fewshot)
    result = evaluate_model(run.model, run.tokenizer_path, list(settings.tasks), limit=settings.limit,
                            batch_size=cfg.eval.batch_size, num_fewshot=settings.num_fewshot,
                            eos_token=run_eos_token(spec, run.tokenizer_path))
    folder = write_record(spec, settings, result, task_summary(result["items"]))
    record = json.loads((folder / EVAL_RECORD).read_text())
    tracker = Tracker.attach(spec.key, cfg.experiment, cfg=cfg.tracking)

    def logged(client, run_id: str) -> set[str]:
        """The metrics whose history already holds this value at the step (an earlier run of this evaluation)."""
        return {key for key, value in record["metrics"].items() if any(
            m.step == settings.step and m.value == value for m in client.get_metric_history(run_id, key))}

    # if the run's history cannot be read, a repeated point is logged rather than a new one lost
    held = tracker.record("logged scores", logged) or set()
    tracker.log_metrics({k: v for k, v in record["metrics"].items() if k not in held}, settings.step)
    tracker.log_artifact(folder, eval_artifact(settings.id))
    if left := tracker.close():
        raise StudyError("tracking.uri", f"evaluation {settings.id} is recorded in {folder}, but {left} of its "
                         "metric points and artifacts did not reach MLflow",
                         "run the same `study eval` again once the store answers: it records the same evaluation "
                         "again, in both places")
    if is_of_record(spec, settings):
        # which evaluation the eval/<task>/* scores are: tagged once its points and artifacts have landed
        _set_tags(spec, tracker.run_id, {TAG_EVAL + task: settings.id for task in settings.tasks})
        from study.track.groups import refresh

        tracker.record("parent summary", refresh)  # the variant's mean and spread include these scores
    return record


def _set_tags(spec: RunSpec, run_id: str, tags: dict[str, str]) -> None:
    """Tags on the run now, retrying a transient failure for tracking.open_timeout_s as the tracker does."""
    from mlflow.entities import RunTag

    from study.track.store import call_with_retries, mlflow_client, resolve_tracking_uri

    cfg = spec.config.tracking
    client = mlflow_client(resolve_tracking_uri(cfg.uri))
    batch = [RunTag(k, v) for k, v in tags.items()]
    call_with_retries(lambda: client.log_batch(run_id, tags=batch, synchronous=True), cfg,
                      time.monotonic() + cfg.open_timeout_s, "tags")
