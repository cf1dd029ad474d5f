"""Study 2's pipeline end to end on the local launcher: the reference trains, its profile is measured, and the
scheduled runs train with widths allocated from it under the same parameter budget."""

from __future__ import annotations

import json

import pytest

from conftest import TRAINING_RUNS

from slurm_helpers import SMALL, private_sweeps


@pytest.fixture
def geometry_experiment(workdir, monkeypatch):
    common = {**SMALL["common"], "model": {**SMALL["common"]["model"], "n_layers": 4},
              "geometry": {"n_tokens": 96}}
    private_sweeps(workdir, "geo", baseline="uniform", reference={"variant": "uniform", "seed": 0},
                   variants={"uniform": {"model": "uniform"}, "geometry": {"model": "geometry"},
                             "anti": {"model": "anti"}}, common=common)
    monkeypatch.setenv("STUDY_SWEEPS", str(workdir / "sweeps"))
    return "geo"


@pytest.mark.integration
def test_reference_profile_then_scheduled_runs_train_at_the_budget(geometry_experiment, workdir, capsys):
    from mlflow import MlflowClient

    from study.cli import main
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    before = plan_experiment("geo")
    pending = [r for r in before.runs if r.config.role == "scheduled"]
    assert pending and all(r.pending and r.params is None for r in pending)

    stages = launch("geo", ["cluster=local"], echo=lambda m: None)
    # the session's data cache may not hold these shards yet: then a prepare stage comes first
    assert [s.name for s in stages if s.name != "prepare"] == ["train", "profile", "scheduled"]

    after = plan_experiment("geo")
    ref = next(r for r in after.runs if r.config.role == "reference")
    profile = json.loads((workdir / "runs" / "geo" / ref.key / "profile.json").read_text())
    assert profile["layers"] == 4 and set(profile["stats"]) == {"shift", "gw", "topo"}
    assert all(len(profile["stats"][s][g]) == 4 for s in profile["stats"] for g in ("raw", "spherical", "hyperbolic"))
    assert len(profile["intrinsic_dim"]) == 4
    scheduled = {r.config.variant: r for r in after.runs if r.config.role == "scheduled"}
    for run in scheduled.values():
        assert run.pending is None and abs(run.mismatch) <= run.config.budget.tolerance
        assert run.params['counted'] == ref.params['counted'] or abs(run.mismatch) > 0
    geo, anti = scheduled["geometry"].model.ffn.widths, scheduled["anti"].model.ffn.widths
    assert geo != anti and len(set(geo)) > 1
    from study.config.spec import read_spec

    for planned in pending:  # each job completed its own spec from the profile and wrote it back
        written = read_spec(planned.dir)
        assert written.key == planned.key and written.pending is None
        assert written.model.ffn.widths == scheduled[planned.config.variant].model.ffn.widths

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("geo").experiment_id], filter_string=TRAINING_RUNS)
    assert sorted(r.data.tags["study.role"] for r in runs) == ["reference", "scheduled", "scheduled"]
    assert all(r.info.status == "FINISHED" for r in runs)
    trained = {r.data.tags["study.variant"]: r for r in runs}
    assert json.loads(trained["geometry"].data.params["resolved.ffn_widths"]) == geo
    artifacts = [a.path for a in client.list_artifacts(trained["uniform"].info.run_id, "geometry")]
    assert {"geometry/profile.json", "geometry/profile.png", "geometry/widths.png"} <= set(artifacts)

    capsys.readouterr()
    assert main(["allocate", "--profile", str(workdir / "runs" / "geo" / ref.key / "profile.json"),
                 "--statistic", "topo", "--geometry", "hyperbolic", "--budget-from", "geo:tiny", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["widths"] == geo and abs(printed["mismatch"]) <= 1e-2

    assert main(["profile", ref.key, "geometry.n_tokens=64", "geometry.seed=3"]) == 0  # re-profile, same run key
    again = json.loads((workdir / "runs" / "geo" / ref.key / "profile.json").read_text())
    assert again["n_tokens"] == 64 and again["run_key"] == ref.key
