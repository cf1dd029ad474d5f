"""Every evaluation of a run is its own record, `<run dir>/evals/<id>/` (mirrored among the MLflow run's artifacts),
the id naming its settings (tasks, limit, few-shot examples, step) readably and by hash: the same evaluation lands in
the same record. The final checkpoint scored with the configured `eval.limit` and `eval.num_fewshot` is the run's
evaluation *of record*, whose scores are the `eval/<task>/<metric>` metrics the report reads; any other is logged
under `evals/<id>/<task>/<metric>`, visible beside them and never taken for them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from study.config.identity import json_digest
from study.config.spec import RunSpec, finished_result
from study.files import COUNT, FLAG, MAPPING, NUMBER, TEXT, TEXTS, read_mapping
from study.schema import EVAL_PREFIX, EVAL_RECORD, EVAL_RESULTS, ITEMS_ARTIFACT, eval_artifact


@dataclass(frozen=True)
class EvalSettings:
    """What one evaluation scored, and how."""

    tasks: tuple[str, ...]
    """lm-eval task names, sorted."""
    limit: int | None
    """Documents per task; None means every document."""
    num_fewshot: int
    """Solved examples put before each prompt."""
    step: int
    """Optimizer step of the checkpoint scored."""

    @property
    def id(self) -> str:
        digest = json_digest(asdict(self), 8)
        items = "all" if self.limit is None else f"limit{self.limit}"
        return f"step{self.step:08d}-{items}-{self.num_fewshot}shot-{digest}"


def settings_for(spec: RunSpec, tasks: list[str], step: int, limit: int | None = None,
                 num_fewshot: int | None = None) -> EvalSettings:
    """The settings of an evaluation, the run's `eval.limit` / `eval.num_fewshot` where not given (limit 0: all)."""
    cfg = spec.config.eval
    limit = cfg.limit if limit is None else limit
    return EvalSettings(tuple(sorted(set(tasks))), limit or None, cfg.num_fewshot if num_fewshot is None
                        else num_fewshot, step)


def final_step(spec: RunSpec) -> int | None:
    """The step the run finished training at (None until it finished)."""
    result = finished_result(spec)
    return int(result["step"]) if result is not None else None


def is_of_record(spec: RunSpec, settings: EvalSettings) -> bool:
    """Whether these are the run's configured settings on its final checkpoint (the scores are `eval/<task>/*`)."""
    cfg = spec.config.eval
    return (settings.limit, settings.num_fewshot, settings.step) == (cfg.limit or None, cfg.num_fewshot,
                                                                    final_step(spec))


def write_record(spec: RunSpec, settings: EvalSettings, result: dict, summary: dict) -> Path:
    """The evaluation's folder (its record with settings, task summary and scores under their MLflow names, lm-eval's
    results, the per-item scores), written whole and then moved into place."""
    of_record = is_of_record(spec, settings)
    prefix = EVAL_PREFIX if of_record else eval_artifact(settings.id) + "/"  # any other: `evals/<id>/`
    record = {"id": settings.id, "run_key": spec.key, "checkpoint": f"step_{settings.step:08d}", **asdict(settings),
              "of_record": of_record, "time": time.time(), "tasks_summary": summary,
              "metrics": {prefix + name[len(EVAL_PREFIX):]: value for name, value in result["metrics"].items()}}
    folder = spec.run_dir.evals / settings.id
    tmp = folder.with_name(f".{settings.id}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / EVAL_RECORD).write_text(json.dumps(record, indent=1))
    (tmp / EVAL_RESULTS).write_text(json.dumps(result["lm_eval"], default=str, indent=1))
    lines = [json.dumps({"task": task, **row}) for task, rows in result["items"].items() for row in rows]
    (tmp / ITEMS_ARTIFACT).write_text("".join(line + "\n" for line in lines))
    # The same settings again: the same (deterministic) evaluation, so its record is rewritten, not a second one.
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


_RECORD = {"id": TEXT, "step": COUNT, "tasks": TEXTS, "of_record": FLAG, "time": NUMBER, "metrics": MAPPING}
"""The fields of an evaluation record that its readers use."""


def read_records(spec: RunSpec) -> list[dict]:
    """Every evaluation record of the run, oldest first; a damaged one is refused by name."""
    folder = spec.run_dir.evals
    records = []
    for path in sorted(folder.glob(f"*/{EVAL_RECORD}")) if folder.is_dir() else []:
        if path.parent.name.startswith("."):  # one being written (or left by a killed evaluation) is none yet
            continue
        records.append(read_mapping(path, _RECORD, f"delete {path.parent}: `study eval {spec.key}` (for the "
                                    "evaluation of record, the next `study launch`) evaluates again and rewrites it"))
    return sorted(records, key=lambda r: r["time"])


def evaluated(spec: RunSpec) -> bool:
    """Whether the run has an evaluation of record of its final checkpoint covering its configured tasks."""
    wanted, final = set(spec.config.eval.tasks), final_step(spec)
    return final is not None and any(r["of_record"] and r["step"] == final and set(r["tasks"]) >= wanted
                                     for r in read_records(spec))
