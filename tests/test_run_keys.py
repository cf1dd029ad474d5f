"""Every shipped experiment plans to the run keys it planned when they were last changed on purpose: a refactoring
that moves code never moves a key (which would orphan every finished run of a study).

A deliberate key change (a new key schema, said in its commit) is taken into the golden file by running
`python tests/test_run_keys.py > tests/golden/run_keys.json`.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT

GOLDEN = ROOT / "tests" / "golden" / "run_keys.json"
EXPERIMENTS = sorted(p.stem for p in (ROOT / "sweeps" / "experiment").glob("*.yaml"))


def planned_keys(experiment: str) -> dict[str, str]:
    from study.plan.planner import plan_experiment

    return {spec.name: spec.key for spec in plan_experiment(experiment).runs}


def test_the_golden_file_covers_every_shipped_experiment():
    assert sorted(json.loads(GOLDEN.read_text())) == EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_plans_to_its_recorded_run_keys(experiment, tmp_path, monkeypatch):
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # paths.runs is relative: no profile of an earlier run is found
    assert planned_keys(experiment) == json.loads(GOLDEN.read_text())[experiment]


@pytest.mark.parametrize("field", ["init_seed", "data_seed"])
def test_a_seed_written_out_at_the_run_seed_plans_the_key_of_the_unset_seed(field, tmp_path, monkeypatch):
    from study.plan.planner import plan_experiment

    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    golden = json.loads(GOLDEN.read_text())["demo"]
    written = {spec.name: spec.key for spec in plan_experiment("demo", [f"{field}=0"]).runs}
    # seed 0 wrote out its own seed: the same model, the same key, for the main runs and the tune runs (all seed 0, so
    # the main runs' tuning is unchanged too); seeds 1 and 2 now train on seed 0's draw
    assert {n: k == golden[n] for n, k in written.items()} == {n: n.endswith("-s0") or "-s0-lr" in n for n in golden}


UNTUNED_DEMO_SEED_0 = {"conventional": "8f726644be75", "hourglass": "cf1ad7d51758", "tapered": "5b421864b162"}
"""The demo's seed-0 run keys before it declared tuning (its shared-LR runs)."""


def test_the_demos_multiple_1_tune_points_are_its_earlier_shared_lr_seed_0_runs():
    """The tiny scale writes its LR out, so a tune point at x1 is the shared-LR run of that seed, key and all: a
    store that holds the untuned demo already holds those tune points, and `study launch` trains them no more."""
    golden = json.loads(GOLDEN.read_text())["demo"]
    assert {v: golden[f"{v}-tiny-s0-lr1"] for v in UNTUNED_DEMO_SEED_0} == UNTUNED_DEMO_SEED_0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps({e: planned_keys(e) for e in EXPERIMENTS}, indent=1, sort_keys=True))


def test_the_layout_never_changes_a_run_key(tmp_path, monkeypatch, capsys):
    """Nodes, ranks, sharding and the collective timeout say where a run trains, not what it computes: a run moved to
    more nodes resumes as itself. A sharding that does not exist is refused naming the field."""
    from study.cli import main
    from study.plan.planner import plan_experiment

    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    keys = {tuple(o): [s.key for s in plan_experiment("hourglass_release", list(o)).runs]
            for o in ([], ["cluster=h100", "cluster.nodes=8", "train.sharding=hybrid"],
                      ["cluster.nodes=2", "cluster.tasks_per_node=4", "train.sharding=full",
                       "train.collective_timeout_s=60"])}
    assert len({tuple(v) for v in keys.values()}) == 1
    assert main(["plan", "demo", "train.sharding=zero3"]) == 2
    err = capsys.readouterr().err
    assert "train.sharding" in err and "hybrid" in err
