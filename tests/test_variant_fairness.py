"""A variant may change only what the experiment compares: a `set:`, `at:` or `variants.<v>.<key>=` that places a
run (experiment, variant, scale, seed) or changes what the arms share (recipe, data, seeds, budget, init rule) is
refused with exit 2 naming the field, unless the experiment declares that comparison (`compares:`)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import yaml

from study.cli import main
from study.config.run import leaves

ARMS = {"a": {"model": "conventional"}, "b": {"model": "hourglass"}}


def experiment(tmp_path, monkeypatch, **changes) -> str:
    import shutil

    from conftest import ROOT

    tree = tmp_path / "sweeps"
    if not tree.exists():
        shutil.copytree(ROOT / "sweeps", tree)
    spec = {"baseline": "a", "scales": ["tiny"], "seeds": [0, 1], "variants": ARMS, **changes}
    (tree / "experiment" / "fair.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    return "fair"


def refused(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("field,value,named", [
    ("experiment", "demo", "variants.b.set.experiment"),
    ("variant", "a", "variants.b.set.variant"),
    ("scale", "113M", "variants.b.set.scale"),
    ("seed", 7, "variants.b.set.seed"),
    ("baseline", "b", "variants.b.set.baseline"),
])
def test_a_variant_that_places_its_runs_elsewhere_is_refused_naming_the_field(
        workdir, monkeypatch, capsys, field, value, named):
    name = experiment(workdir, monkeypatch, variants={**ARMS, "b": {"model": "hourglass", "set": {field: value}}})
    err = refused(capsys, "plan", name)
    assert named in err and "experiment file" in err
    assert not (workdir / "runs").exists()


def test_common_or_a_per_scale_block_that_sets_the_seed_is_refused(workdir, monkeypatch, capsys):
    name = experiment(workdir, monkeypatch, common={"seed": 3})
    assert "fair.yaml: common.seed" in refused(capsys, "plan", name)
    name = experiment(workdir, monkeypatch, variants={**ARMS, "b": {"model": "hourglass", "at": {"tiny": {"seed": 3}}}})
    assert "variants.b.at.tiny.seed" in refused(capsys, "plan", name)


@pytest.mark.parametrize("field,value", [
    ("train.max_steps", 240), ("train.lr", 0.5), ("train.global_batch", 64), ("train.warmup_steps", 1),
    ("train.lr_schedule", "wsd"), ("train.weight_decay", 0.0), ("train.val_batches", 9), ("data.max_docs", 77),
    ("data.seq_len", 64), ("model.init_std", 0.01), ("init_seed", 5), ("data_seed", 5), ("budget.mode", "total"),
])
def test_a_variant_that_changes_what_the_arms_share_is_refused_naming_the_field(
        workdir, monkeypatch, capsys, field, value):
    name = experiment(workdir, monkeypatch, variants={**ARMS, "b": {"model": "hourglass", "set": {field: value}}})
    err = refused(capsys, "plan", name)
    assert f"variants.b`: sets {field}={value!r} at scale tiny" in " ".join(err.split())
    assert f"compares: [{field}]" in " ".join(err.split())


def test_a_per_variant_override_of_a_shared_field_is_refused(workdir, monkeypatch, capsys):
    name = experiment(workdir, monkeypatch)
    err = " ".join(refused(capsys, "plan", name, "variants.b.train.max_steps=400").split())
    assert "sets train.max_steps=400" in err
    assert "variants.b" in err
    # the same value for every arm is the experiment's own recipe: planned
    assert main(["plan", name, "train.max_steps=400"]) == 0


def test_a_declared_comparison_lets_the_arms_differ_in_that_field_and_only_that_one(workdir, monkeypatch, capsys):
    from study.plan.planner import plan_experiment

    arms = {**ARMS, "b": {"model": "hourglass", "set": {"train.max_steps": 60}}}
    name = experiment(workdir, monkeypatch, variants=arms, compares=["train.max_steps"], common={
        "train": {"max_steps": 30}})
    plan = plan_experiment(name)
    steps = {r.config.variant: r.recipe.max_steps for r in plan.runs}
    assert steps == {"a": 30, "b": 60}
    assert plan.experiment.compares == ("train.max_steps",)
    for r in plan.runs:  # everything else the arms share stays shared
        other = next(o for o in plan.runs if o.config.seed == r.config.seed and o.config.variant != r.config.variant)
        mine, theirs = leaves(asdict(r.config.data)), leaves(asdict(other.config.data))
        assert mine == theirs and r.config.train.lr == other.config.train.lr
    arms["b"]["set"]["train.lr"] = 0.5  # a second difference that is not declared is still refused
    name = experiment(workdir, monkeypatch, variants=arms, compares=["train.max_steps"])
    assert "sets train.lr=0.5" in " ".join(refused(capsys, "plan", name).split())


@pytest.mark.parametrize("compares,why", [
    (["seed"], "places a run"), (["model.d_model"], "is not a field the arms share"), ("train.lr", "has the wrong type"),
    (["train.colour"], "is not a field the arms share"),
])
def test_a_malformed_compares_block_is_refused(workdir, monkeypatch, capsys, compares, why):
    name = experiment(workdir, monkeypatch, compares=compares)
    err = " ".join(refused(capsys, "plan", name).split())
    assert "fair.yaml: compares" in err and why in err


def test_every_shipped_experiment_declares_no_difference_beyond_its_models():
    from study.config.compose import group_options
    from study.plan.experiment import load_experiment

    for name in group_options("experiment"):
        assert load_experiment(name).compares == (), name


def test_the_report_names_the_declared_difference_and_nothing_else(workdir, monkeypatch):
    """The runs of a declared comparison, logged as training logs them (the hashed config fields as params, the
    run's tags): the report's run notes name the compared field with each side's value, and no other field."""
    from mlflow.tracking import MlflowClient

    from analysis.run_table import read_study
    from study.config.identity import KEY, placement
    from study.plan.planner import plan_experiment
    from study.track.lineage import run_tags
    from study.track.tracker import flatten

    arms = {**ARMS, "b": {"model": "hourglass", "set": {"train.max_steps": 60}}}
    name = experiment(workdir, monkeypatch, variants=arms, compares=["train.max_steps"],
                      common={"train": {"max_steps": 30}})
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment(name)
    for spec in plan_experiment(name).runs:
        params = {k: v for k, v in flatten(asdict(spec.config)).items() if placement(k)[0] == KEY}
        run = client.create_run(exp, tags=run_tags(spec), run_name=spec.name)
        for k, v in params.items():
            client.log_param(run.info.run_id, k, v)
        client.log_metric(run.info.run_id, "val/loss", 3.0 + spec.config.seed)
        client.set_terminated(run.info.run_id)
    notes = " ".join(read_study(name, uri).notes)
    assert "b at tiny: train.max_steps = 60 against a's 30" in notes
    assert notes.count(" against ") == 1  # init_seed, data order, LR and the rest agree, so nothing else is named
