"""The scores the report pairs are final-checkpoint scores, each logged once: an evaluation of a run that has not
finished is recorded beside its scores, never as them; a repeated evaluation adds no second point; a checkpoint
being read is not pruned by the run's training."""

from __future__ import annotations

import fcntl
import json

import pytest
from conftest import TINY, TRAINING_RUNS
from study.cli import main
from study.eval.records import evaluated, read_records
from study.jobs.eval import evaluate_run
from study.plan.planner import select_run
from study.schema import EVAL_RECORD, TAG_EVAL
from study.train import checkpoint
from study.train.loop import train

RUN = [*TINY, "experiment=final", "train.max_steps=8", "train.ckpt_interval=2", "model.max_seq_len=128",
       "eval.limit=4", "eval.tasks=[arc_easy_local]"]
ACC = "eval/arc_easy_local/acc"


def the_run(workdir):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("final").experiment_id], filter_string=TRAINING_RUNS)
    return client, run


def points(client, run, key):
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def steps_kept(spec):
    return [int(p.name.split("_")[-1]) for p in checkpoint.complete_checkpoints(spec.run_dir.path)]


@pytest.mark.integration
def test_an_evaluation_before_training_finished_is_not_of_record_and_the_final_checkpoint_is_evaluated(workdir,
                                                                                                       capsys):
    spec = select_run([*RUN, "faults.stop_at_step=4"])
    assert train(spec).status == "PREEMPTED"
    capsys.readouterr()
    assert main(["eval", spec.key]) == 0  # the run's configured settings, on the step-4 checkpoint
    early = json.loads(capsys.readouterr().out)
    assert (early["step"], early["of_record"]) == (4, False) and not evaluated(spec)
    client, run = the_run(workdir)
    assert not any(k.startswith("eval/") for k in run.data.metrics)
    assert points(client, run, f"evals/{early['id']}/arc_easy_local/acc") == [(4, early["metrics"][
        f"evals/{early['id']}/arc_easy_local/acc"])]

    # a record an older version wrote as of record before the run finished does not count either
    written = spec.run_dir.evals / early["id"] / EVAL_RECORD
    written.write_text(json.dumps({**early, "of_record": True}))
    spec = select_run(RUN)
    assert train(spec).status == "FINISHED"
    assert not evaluated(spec)  # what a relaunch asks: the eval stage still runs

    final = evaluate_run(spec)  # the eval stage after training
    assert (final["step"], final["of_record"]) == (8, True) and evaluated(spec)
    client, run = the_run(workdir)
    assert points(client, run, ACC) == [(8, final["metrics"][ACC])]
    assert run.data.tags[TAG_EVAL + "arc_easy_local"] == final["id"]
    assert [r["step"] for r in read_records(spec)] == [4, 8]


@pytest.mark.integration
def test_a_repeated_evaluation_leaves_one_point_per_metric_and_step(workdir, capsys):
    spec = select_run(RUN)
    assert train(spec).status == "FINISHED"
    capsys.readouterr()
    for _ in range(2):
        assert main(["eval", spec.key]) == 0
        of_record = json.loads(capsys.readouterr().out)
        assert main(["eval", spec.key, "limit=8"]) == 0
        other = json.loads(capsys.readouterr().out)
    client, run = the_run(workdir)
    assert {k: points(client, run, k) for k in of_record["metrics"]} == {
        k: [(8, v)] for k, v in of_record["metrics"].items()}
    assert {k: points(client, run, k) for k in other["metrics"]} == {k: [(8, v)] for k, v in other["metrics"].items()}
    assert len(read_records(spec)) == 2


@pytest.mark.integration
def test_a_checkpoint_being_read_is_not_pruned_by_its_training(workdir, capsys):
    spec = select_run([*RUN, "train.keep_last=1", "faults.stop_at_step=6"])
    assert train(spec).status == "PREEMPTED"
    assert steps_kept(spec) == [6]  # no reader: steps 2 and 4 pruned as they were superseded
    spec = select_run([*RUN, "train.keep_last=1"])
    with checkpoint.reading(spec.run_dir.path):  # as `study eval` holds it while it loads the weights
        assert train(spec).status == "FINISHED"
    assert steps_kept(spec) == [6, 8]

    capsys.readouterr()
    assert main(["eval", spec.key]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 8
    with open(spec.run_dir.checkpoints / checkpoint.READERS) as lease:  # the evaluation let its lease go
        fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
