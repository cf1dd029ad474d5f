"""MLflow as researchers browse it: a parent run per (variant, scale) with its seed runs nested and summarised, the
token shards as a dataset input, source and git tags, a description, the tokenizer and job log as artifacts, system
metrics, and the report run linked to the runs it read."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, TRAINING_RUNS
from slurm_helpers import private_sweeps
from study.cli import main
from study.plan.planner import plan_experiment

# one worker builds the module's expensive fixtures once (xdist would build them on each worker it splits onto)
pytestmark = pytest.mark.xdist_group("mlflow_lineage")


@pytest.fixture(scope="module")
def nested(tmp_path_factory, data_cache):
    """Two variants x two seeds launched once as local processes; the tests read the store."""
    from mlflow import MlflowClient

    workdir = tmp_path_factory.mktemp("nest")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        private_sweeps(workdir, "nest", seeds=[0, 1])
        mp.setenv("STUDY_SWEEPS", str(workdir / "sweeps"))
        overrides = ["cluster=local", "train.max_steps=4", "tracking.system_metrics_s=0.2",
                     "eval.tasks=[arc_easy_local]", "eval.limit=4"]
        assert main(["launch", "nest", *overrides]) == 0
        plan = plan_experiment("nest", overrides)
        for run in plan.runs:
            if run.config.variant == "conventional":  # the evaluation of record, in this process
                assert main(["eval", run.key]) == 0
        client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
        yield client, client.get_experiment_by_name("nest"), plan


@pytest.mark.integration
def test_seed_runs_nest_under_one_parent_per_cell_that_holds_their_mean_and_spread(nested):
    client, exp, _ = nested
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow 3 opens the runs table
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`study.role` = 'group'")
    assert sorted(p.info.run_name for p in parents) == ["conventional-tiny", "hourglass-tiny"]
    runs = client.search_runs([exp.experiment_id], filter_string=TRAINING_RUNS)
    assert len(runs) == 4
    for parent in parents:
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(int(c.data.tags["study.seed"]) for c in children) == [0, 1]
        assert {c.data.tags["study.variant"] for c in children} == {parent.data.tags["study.variant"]}
        losses = [c.data.metrics["val/loss"] for c in children]
        assert parent.data.metrics["val/loss"] == pytest.approx(sum(losses) / 2, rel=1e-12)
        assert parent.data.metrics["val/loss/sd"] == pytest.approx(abs(losses[0] - losses[1]) / 2 ** 0.5, rel=1e-9)
        assert parent.data.metrics["val/loss/n"] == 2
        # the step is the seed count: MLflow shows the value at the largest step, whichever refresh logged last
        assert max(m.step for m in client.get_metric_history(parent.info.run_id, "val/loss")) == 2
        # the folded row names the shards its seed runs trained on (one corpus here: one dataset input)
        assert [i.dataset.digest for i in parent.inputs.dataset_inputs] == sorted(
            {i.dataset.digest for c in children for i in c.inputs.dataset_inputs})
    (conv,) = [p for p in parents if p.data.tags["study.variant"] == "conventional"]
    scores = [r.data.metrics["eval/arc_easy_local/acc"] for r in runs if r.data.tags["study.variant"] == "conventional"]
    assert conv.data.metrics["eval/arc_easy_local/acc"] == pytest.approx(statistics.fmean(scores), rel=1e-12)
    assert conv.data.metrics["eval/arc_easy_local/acc/n"] == 2
    for run in runs:  # an evaluation's score is one value, not a curve
        if run.data.tags["study.variant"] == "conventional":
            assert len(client.get_metric_history(run.info.run_id, "eval/arc_easy_local/acc")) == 1
    from analysis.run_table import read_runs

    assert len(read_runs("nest", client.tracking_uri)) == 4  # parents are not training runs


def test_each_run_records_its_data_code_description_tokenizer_log_and_system_metrics(nested):
    client, exp, _ = nested
    runs = client.search_runs([exp.experiment_id], filter_string=TRAINING_RUNS)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    digests = set()
    for run in runs:
        tags = run.data.tags
        assert tags["mlflow.source.git.commit"] == commit and tags["mlflow.source.type"] == "JOB"
        note = tags["mlflow.note.content"]
        d_model = run.data.params["resolved.d_model"]  # the matched width (the hourglass arm solves its own)
        assert note.startswith(f"{tags['study.variant']} at tiny, seed {tags['study.seed']}: llama L2 d_model={d_model}")
        assert d_model == ("64" if tags["study.variant"] == "conventional" else "56")
        (inp,) = run.inputs.dataset_inputs
        shards = Path(json.loads(inp.dataset.source)["shards"])
        meta = json.loads((shards / "meta.json").read_text())
        profile = json.loads(inp.dataset.profile)
        assert inp.dataset.name == "docstrings" and profile["train_tokens"] == meta["splits"]["train"]["tokens"]
        assert [t.value for t in inp.tags if t.key == "mlflow.data.context"] == ["training"]
        digests.add(inp.dataset.digest)
        got = Path(client.download_artifacts(run.info.run_id, "tokenizer/tokenizer.json"))
        assert got.read_bytes() == (shards / "tokenizer.json").read_bytes()
        logs = [a.path for a in client.list_artifacts(run.info.run_id, "logs")]
        assert logs, "the job's log is an artifact"
        text = "".join(Path(client.download_artifacts(run.info.run_id, p)).read_text() for p in logs)
        assert run.info.run_name in text  # the job's own progress line names the run
        assert any(k.startswith("system/cpu_utilization_percentage") for k in run.data.metrics)
    assert len(digests) == 1  # paired runs train on the same shards


def test_the_report_run_lists_the_runs_it_read_and_each_points_back(nested, capsys):
    client, exp, _ = nested
    assert main(["report", "nest", "--json"]) == 0
    report_id = json.loads(capsys.readouterr().out)["report_run_id"]
    runs = client.search_runs([exp.experiment_id], filter_string=TRAINING_RUNS)
    listed = json.loads(Path(client.download_artifacts(report_id, "runs.json")).read_text())["runs"]
    assert sorted(r["run_id"] for r in listed) == sorted(r.info.run_id for r in runs)
    assert client.get_run(report_id).data.tags["study.report.runs"] == "4"
    assert all(client.get_run(r.info.run_id).data.tags["study.report_run_id"] == report_id for r in runs)


def test_each_trainer_leaves_its_last_figures_for_the_launch_board(nested):
    from study.launch.local import DONE, LiveTable

    client, exp, plan = nested
    board = LiveTable(plan.runs)
    board.mark(plan.runs[0].key, DONE)
    by_key = {r.data.tags["study.run_key"]: r for r in client.search_runs([exp.experiment_id],
                                                                         filter_string=TRAINING_RUNS)}
    for run, row in zip(plan.runs, board.rows(), strict=True):
        loss = [m for m in client.get_metric_history(by_key[run.key].info.run_id, "train/loss") if m.step == 4]
        assert row[:4] == (run.name, board.states[run.key], "4/4", f"{loss[0].value:.4f}")
    assert board.rows()[0][5] == "-" and board.rows()[1][5] == "0:00"  # nothing left to wait for
