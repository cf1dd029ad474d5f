"""`study eval RUN_KEY`: lm-eval on a trained run's checkpoint; scores land in that run's MLflow record and in its
run directory alike. lm-eval's own CLI (`python -m study.eval --model study ...`) scores the same run the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, TRAINING_RUNS
from study.cli import main
from study.errors import StudyError
from study.eval.harness import LOCAL_TASK_DIR
from study.plan.planner import select_run
from study.schema import EVAL_RECORD, ITEMS_ARTIFACT, TAG_EVAL, eval_artifact
from study.train.loop import train

RUN = [*TINY, "experiment=evalrun", "train.max_steps=6", "model.max_seq_len=128"]


def trained(*overrides: str):
    spec = select_run([*RUN, *overrides])
    assert train(spec).status == "FINISHED"
    return spec


def mlflow_run(workdir):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("evalrun").experiment_id], filter_string=TRAINING_RUNS)
    return client, run


@pytest.mark.integration
def test_eval_scores_a_trained_run_into_its_own_mlflow_run_and_run_directory(workdir, capsys, tmp_path):
    spec = trained("eval.limit=8")  # the run's configured evaluation: 8 documents per task
    capsys.readouterr()
    assert main(["eval", spec.key, "tasks=arc_easy_local,piqa_local"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["of_record"] and (record["limit"], record["num_fewshot"], record["step"]) == (8, 0, 6)
    assert record["tasks_summary"] == {"arc_easy_local": {"items": 8, "chance": 0.25},
                                       "piqa_local": {"items": 8, "chance": 0.5}}
    folder = spec.run_dir.evals / record["id"]
    assert json.loads((folder / EVAL_RECORD).read_text()) == record
    items = [json.loads(line) for line in (folder / ITEMS_ARTIFACT).read_text().splitlines()]
    arc = [row["acc"] for row in items if row["task"] == "arc_easy_local"]
    assert len(arc) == 8 and record["metrics"]["eval/arc_easy_local/acc"] == pytest.approx(sum(arc) / 8, abs=1e-12)

    client, run = mlflow_run(workdir)
    assert run.info.status == "FINISHED"  # evaluation adds scores, it does not reopen the run
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("eval/")} == record["metrics"]
    assert run.data.tags[TAG_EVAL + "arc_easy_local"] == run.data.tags[TAG_EVAL + "piqa_local"] == record["id"]
    logged = client.download_artifacts(run.info.run_id, eval_artifact(record["id"], EVAL_RECORD), str(tmp_path))
    assert json.loads(open(logged).read()) == record
    from analysis.items import read_items

    (read,) = read_items(client, [run.info.run_id]).values()  # what the report bootstraps over
    assert read.to_dict("records") == items
    assert main(["eval", spec.key, "tasks=no_such_task_local"]) == 2
    assert "`tasks`" in capsys.readouterr().err


@pytest.mark.integration
def test_lm_eval_cli_scores_a_run_from_another_directory_as_study_eval_does(workdir, capsys, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from study.eval.harness import StudyLM

    spec = trained()
    capsys.readouterr()
    assert main(["eval", spec.key, "tasks=arc_easy_local", "limit=6", "num_fewshot=1"]) == 0
    record = json.loads(capsys.readouterr().out)
    ours = json.loads((spec.run_dir.evals / record["id"] / "eval.json").read_text())
    assert ours["configs"]["arc_easy_local"]["num_fewshot"] == 1 and not record["of_record"]

    elsewhere, out = tmp_path / "elsewhere", tmp_path / "lm-eval-out"
    elsewhere.mkdir()  # no runs/ and no mlflow.db here: the run is found through the store's record of it
    command = [sys.executable, "-m", "study.eval", "--model", "study",
               "--model_args", f"run={spec.key},tracking_uri=sqlite:///{workdir}/mlflow.db",
               "--tasks", "arc_easy_local", "--include_path", str(LOCAL_TASK_DIR), "--limit", "6",
               "--num_fewshot", "1", "--batch_size", "16", "--output_path", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = out.rglob("results_*.json")
    theirs = json.loads(written.read_text())
    assert theirs["results"]["arc_easy_local"] == ours["results"]["arc_easy_local"]
    assert theirs["n-samples"] == ours["n-samples"] == {"arc_easy_local": {"original": 48, "effective": 6}}

    # checkpoint=PATH names the same weights without a key
    ckpt = spec.run_dir.checkpoints / "step_00000006"
    lm = StudyLM.create_from_arg_string(f"checkpoint={ckpt}", {"batch_size": 16, "device": None})
    direct = simple_evaluate(model=lm, tasks=["arc_easy_local"], limit=6, num_fewshot=1,
                             task_manager=TaskManager(include_path=str(LOCAL_TASK_DIR), include_defaults=False))
    assert direct["results"]["arc_easy_local"] == ours["results"]["arc_easy_local"]
    with pytest.raises(StudyError, match="exactly one of run=KEY and checkpoint=PATH"):
        StudyLM.create_from_arg_string(f"run={spec.key},checkpoint={ckpt}")
