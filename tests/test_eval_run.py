"""`study eval RUN_KEY`: lm-eval on a trained run's checkpoint; scores land in that run's MLflow record."""

from __future__ import annotations

import json

from conftest import TINY, TRAINING_RUNS
from study.cli import main
from study.plan.planner import select_run
from study.train.loop import train


def test_eval_scores_a_trained_run_into_its_own_mlflow_run(workdir, capsys):
    cfg = select_run([*TINY, "experiment=evalrun", "train.max_steps=6", "model.max_seq_len=128"])
    assert train(cfg).status == "FINISHED"
    key = cfg.key
    capsys.readouterr()
    assert main(["eval", key, "tasks=arc_easy_local,piqa_local", "limit=8"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert 0.0 <= printed["eval/arc_easy_local/acc"] <= 1.0 and "eval/piqa_local/acc_norm" in printed
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("evalrun").experiment_id], filter_string=TRAINING_RUNS)
    assert run.info.status == "FINISHED"  # evaluation adds scores, it does not reopen the run
    assert run.data.metrics["eval/arc_easy_local/acc"] == printed["eval/arc_easy_local/acc"]
    assert "eval.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert main(["eval", key, "tasks=no_such_task_local"]) == 2
    assert "`tasks`" in capsys.readouterr().err
