"""`study launch --until-decided` on cluster=local with real training: seeds added where undecided, every look in
MLflow, `study status` and `study report` see the added seeds, and the same command again replays without training."""

from __future__ import annotations

import json

import pytest

from slurm_helpers import private_sweeps
from study.cli import main


@pytest.fixture
def adaptive_experiment(workdir, monkeypatch):
    private_sweeps(workdir, "adapt", seeds=[0, 1])
    monkeypatch.setenv("STUDY_SWEEPS", str(workdir / "sweeps"))
    return "adapt"


@pytest.mark.integration
def test_adaptive_launch_adds_seeds_logs_looks_and_replays(adaptive_experiment, workdir, capsys):
    from mlflow import MlflowClient

    from analysis.sequential import read_looks
    from study.launch.status import experiment_status

    args = ["launch", "adapt", "cluster=local", "train.max_steps=6", "--until-decided", "--max-seeds", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # two pairs cannot decide anything at alpha 0.05 * 2/3: one more seed for both sides, then the seed cap
    assert "look 1: 2 seed pairs" in out and "adding conventional@tiny seed 2, hourglass@tiny seed 2" in out
    assert "stopped after 2 looks: max seeds reached (3)" in out
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp_id = client.get_experiment_by_name("adapt").experiment_id
    looks = read_looks(client, exp_id)
    assert [(look["round"], look["n"]) for look in looks] == [(1, 2), (2, 3)]
    assert sum(look["alpha"] for look in looks) == pytest.approx(0.05)
    (seq,) = client.search_runs([exp_id], filter_string="tags.`study.role` = 'sequential'")
    assert [m.value for m in client.get_metric_history(seq.info.run_id, "look/n")] == [2, 3]
    assert seq.data.tags["study.verdict.tiny.hourglass"] == looks[-1]["decisions"][0]["verdict"]
    rows = experiment_status("adapt", [])
    assert sorted((r.name, r.verdict) for r in rows) == [
        (f"{v}-tiny-s{s}", "finished") for v in ("conventional", "hourglass") for s in (0, 1, 2)]
    assert main(["report", "adapt", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (primary,) = [d for d in report["decisions"] if d["family"] == "primary"]
    assert primary["n"] == 3 and primary == looks[-1]["decisions"][0]
    assert report["looks"] == looks and "adaptive launch with 2 looks" in report["sequential"]
    # the same command again: every look replays on the runs already there, nothing is trained
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "done" not in again and again.count("nothing to submit") == 2
    assert read_looks(client, exp_id) == looks
    # a plain relaunch keeps the added seeds in the launch, so status still lists them
    assert main(["launch", "adapt", "cluster=local", "train.max_steps=6"]) == 0
    assert len(experiment_status("adapt", [])) == 6
