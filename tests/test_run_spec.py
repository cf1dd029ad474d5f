"""Run identity, the one composer and the run spec: what changes a key, what does not, and that jobs build from the
spec alone."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, TRAINING_RUNS
from study.cli import main
from study.config.compose import nested
from study.config.identity import FIELDS, KEY, OUT, SCHEDULED, placement, run_key
from study.config.model import FAMILIES
from study.config.run import RunConfig
from study.config.spec import read_spec, write_spec
from study.errors import StudyError
from study.plan.planner import plan_adhoc, plan_experiment


def leaves(cls, prefix=""):
    """Every leaf field of a config dataclass, by dotted name, with its default."""
    out = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out.update(leaves(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = default
    return out


# fields whose typed config checks its own choices get another valid value
ALTERNATIVES = {"geometry.statistic": "gw", "geometry.geometry": "raw", "geometry.smoothing": "none",
                "geometry.exponent": "constant", "geometry.hyperbolic_radius": 0.5, "geometry.w_min_fraction": 0.5,
                "geometry.diagram_workers": 2, "geometry.vr_backend": "ripser", "model.ffn.schedule.family": "linear",
                "geometry.gw_starts": "both"}


# a width-schedule family that reads each schedule parameter (study.config.model.FAMILIES)
READER = {"start": "cosine", "end": "cosine", "steepness": "sigmoid", "beta": "layerwise", "alpha": "layerwise",
          "isotropic_ends": "layerwise", "reverse": "cosine"}


def changed(value, dotted=""):
    if dotted in ALTERNATIVES:
        return ALTERNATIVES[dotted]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, "x"]
    return [1]  # None


def with_field(cfg: RunConfig, dotted: str, value) -> RunConfig:
    *parents, leaf = dotted.split(".")
    if not parents:
        return dataclasses.replace(cfg, **{leaf: value})
    head, rest = parents[0], ".".join([*parents[1:], leaf])
    return dataclasses.replace(cfg, **{head: with_field(getattr(cfg, head), rest, value)})


def test_every_config_field_is_placed_on_one_side_of_the_key():
    fields = leaves(RunConfig)
    assert len(fields) > 100
    for dotted in fields:
        side, reason = placement(dotted)
        assert side in (KEY, OUT, SCHEDULED) and reason
    assert set(FIELDS) <= {p for d in fields for p in [".".join(d.split(".")[:n]) for n in range(1, 4)]}


@pytest.mark.parametrize("scheduled", [False, True], ids=["trained", "geometry-scheduled"])
def test_a_field_changes_the_key_exactly_when_it_is_placed_in_it(scheduled):
    base = RunConfig()
    if scheduled:
        base = with_field(base, "model.ffn.schedule.family", "geometry")
    upstream = ["abcdef012345"] if scheduled else None
    key = run_key(base, upstream)
    family = base.model.ffn.schedule.family
    for dotted, default in leaves(RunConfig).items():
        side = placement(dotted)[0]
        start, start_key = base, key
        if dotted == "geometry.measure_sensitivity":  # measuring no sensitivity is valid only without its weights
            start = with_field(base, "geometry.weight_by_sensitivity", False)
            start_key = run_key(start, upstream)
        moved = run_key(with_field(start, dotted, changed(default, dotted)), upstream) != start_key
        param = dotted.removeprefix("model.ffn.schedule.")
        if param in READER and param not in FAMILIES[family] and param not in ("start", "end"):
            # another family's parameter cannot change this model; under a family that reads it, it is in the key
            assert not moved, dotted
            reader = with_field(start, "model.ffn.schedule.family", READER[param])
            moved = run_key(with_field(reader, dotted, changed(default, dotted))) != run_key(reader)
        assert moved == (side == KEY or (scheduled and side == SCHEDULED)), dotted
    if scheduled:
        assert run_key(base, ["0123456789ab"]) != key  # another reference is another run


def keys_of(*overrides):
    return {r.name: r.key for r in plan_experiment("demo", list(overrides)).runs}


@pytest.mark.integration
def test_estimates_cadences_and_cluster_resources_leave_every_key_unchanged():
    base = keys_of()
    for over in (["train.assumed_mfu=0.5"], ["train.log_interval=10"], ["train.val_interval=7"],
                 ["train.ckpt_interval=9", "train.keep_last=5"], ["cluster=slurm"], ["cluster=h100"],
                 ["eval.limit=4"], ["tracking.flush_interval_s=9"], ["paths.runs=elsewhere"]):
        assert keys_of(*over) == base, over


def test_recipe_data_seed_and_per_variant_settings_change_exactly_their_runs():
    base = keys_of()
    for over in (["train.lr=1e-3"], ["data.seq_len=64"], ["model.ffn.multiple_of=8"]):
        assert not set(keys_of(*over).values()) & set(base.values()), over
    k8 = plan_experiment("demo", ["variants.hourglass.model.ffn.k=8"])
    for run in k8.runs:
        assert (run.key == base[run.name]) == (run.config.variant != "hourglass"), run.name
        assert run.model.ffn.k == (8 if run.config.variant == "hourglass" else 1)
        assert abs(run.mismatch) <= run.config.budget.tolerance
    assert len({r.config.seed for r in k8.runs}) == 3 and len({r.key for r in k8.runs}) == len(k8.runs) == 9 + 9  # + tune


@pytest.mark.parametrize("override,hint", [("variant=hourglass", "--variant"), ("seed=5", "--seed"),
                                           ("scale=113M", "variants."), ("experiment=other", "--scale")])
def test_fields_the_experiment_owns_cannot_be_overridden(override, hint, capsys):
    assert main(["plan", "demo", override]) == 2
    err = capsys.readouterr().err
    assert f"`{override.split('=')[0]}`" in err and hint in err and "Traceback" not in err


def test_runs_are_selected_with_flags_not_overrides(capsys):
    assert main(["plan", "demo", "--json", "--variant", "hourglass", "--seed", "1"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["name"] == "hourglass-tiny-s1" and run["run_key"] == keys_of()["hourglass-tiny-s1"]
    assert main(["plan", "demo", "--variant", "nosuch"]) == 2


def test_unknown_keys_are_errors_with_or_without_a_plus():
    for over in ("+train.foo=1", "train.foo=1", "+totally_bogus.key=3", "++train.foo=2", "~train.nosuch"):
        with pytest.raises(StudyError):
            plan_adhoc(["scale=tiny", over])


def test_hydra_grammar_sets_and_resets_fields():
    assert plan_adhoc(["scale=tiny", "++train.lr=1e-3"]).config.train.lr == 1e-3
    assert plan_adhoc(["scale=tiny", "+train.lr=1e-3"]).config.train.lr == 1e-3
    assert plan_adhoc(["scale=tiny", "~train.lr"]).config.train.lr == RunConfig().train.lr  # the typed default
    dropped = plan_adhoc(["scale=tiny", "~cluster"]).config.cluster
    assert dropped == RunConfig().cluster


def test_an_adhoc_run_is_named_after_its_presets():
    spec = plan_adhoc(["scale=113M", "model=hourglass_depth", "seed=5"])
    assert spec.name == "hourglass_depth-113M-s5" and spec.model.d_model == 768 and spec.config.seed == 5
    assert spec.model.ffn.kind == "hourglass" and abs(spec.mismatch) <= 1e-5 and spec.model.n_layers == 22
    width = plan_adhoc(["scale=113M", "model=hourglass"])  # the scale's L and attention kept, d_model solved
    assert (width.model.n_layers, width.model.n_heads * width.model.dim_head) == (12, 768)
    assert width.model.d_model == 848 and abs(width.mismatch) <= 1e-5


@pytest.mark.integration
def test_study_train_and_the_hydra_entry_point_train_the_same_run(workdir):
    over = [*TINY, "model.d_model=96", "model.n_heads=3", "train.max_steps=2", "model.ffn.schedule.start=1.25"]
    out = subprocess.run([sys.executable, "-m", "study.cli", "train", *over, "--cfg", "job"], cwd=workdir,
                         capture_output=True, text=True, env=os.environ, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import yaml

    printed = yaml.safe_load(out.stdout)
    hydra = subprocess.run([sys.executable, "-m", "study.train", *over, "hydra.run.dir=hydra-out"], cwd=workdir,
                           capture_output=True, text=True, env=os.environ, timeout=600)
    assert hydra.returncode == 0, hydra.stderr[-3000:]
    spec = read_spec(workdir / "runs" / "adhoc" / printed["key"])
    assert spec.key == printed["key"] and spec.budget == printed["budget"] and spec.name == "conventional-tiny-s0"
    for cmd in ([sys.executable, "-m", "study.cli", "train"], [sys.executable, "-m", "study.train"]):
        bad = subprocess.run([*cmd, *TINY, "+train.foo=1", "hydra.run.dir=hydra-bad"], cwd=workdir,
                             capture_output=True, text=True, env=os.environ, timeout=300)
        assert bad.returncode == 2 and "train.foo" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_a_spec_round_trips_and_another_schema_is_named(tmp_path):
    spec = plan_adhoc(["scale=tiny", f"paths.runs={tmp_path}"])
    path = write_spec(spec)
    assert read_spec(path) == spec and read_spec(path.parent) == spec
    raw = json.loads(path.read_text())
    raw["schema"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(StudyError, match="schema 1"):
        read_spec(path)


def test_a_spec_written_before_the_recipe_carried_its_schedule_trains_its_configs_schedule(tmp_path):
    """A run.json whose recipe lacks lr_schedule and decay_fraction (written before the recipe carried them) reads
    them from the config it carries, the schedule it was planned and trained with: the same spec, the same LR at
    every step."""
    from study.train.optim import lr_factor

    spec = plan_adhoc(["scale=tiny", f"paths.runs={tmp_path}", "train.lr_schedule=wsd", "train.decay_fraction=0.3",
                       "train.max_steps=10", "train.warmup_steps=1"])
    path = write_spec(spec)
    raw = json.loads(path.read_text())
    del raw["recipe"]["lr_schedule"], raw["recipe"]["decay_fraction"]
    path.write_text(json.dumps(raw))
    old = read_spec(path)
    assert (old.planned.lr_schedule, old.planned.decay_fraction) == ("wsd", 0.3)
    assert old == spec
    # warm-up 1 step, the peak up to step 10 - int(0.3 x 10) = 7, then linear down to min_lr_ratio 0.1 at step 10
    expected = [1.0] * 7 + [1 - 0.9 * (s - 7) / 3 for s in range(7, 11)]
    assert [lr_factor(s, old.planned) for s in range(11)] == pytest.approx(expected, rel=1e-12)


def private_tree(workdir, name, experiment):
    import yaml

    tree = workdir / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    (tree / "experiment" / f"{name}.yaml").write_text(yaml.safe_dump(experiment))
    return tree


@pytest.fixture
def tiny_experiment(workdir, monkeypatch):
    # the scale file keeps its depth, so editing it after launch would change the shape
    settings = dict(o.split("=", 1) for o in TINY if not o.startswith(("scale=", "model.n_layers=")))
    common = nested({dotted: yaml_value(value) for dotted, value in settings.items()})
    common.setdefault("train", {}).update({"max_steps": 4, "val_interval": 2, "ckpt_interval": 2})
    tree = private_tree(workdir, "specx", {"baseline": "conventional", "scales": ["tiny"], "seeds": [0, 1],
                                           "variants": {"conventional": {"model": "conventional"},
                                                        "hourglass": {"model": "hourglass"}},
                                           "common": common})
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    return tree


def yaml_value(text):
    import yaml

    return yaml.safe_load(text)


@pytest.mark.integration
def test_a_job_trains_the_planned_shape_after_the_sweeps_tree_changes(tiny_experiment, workdir):
    from study.launch.callables import TrainJob
    from study.launch.submit import write_specs

    plan = plan_experiment("specx", ["variants.hourglass.model.ffn.k=2"])
    write_specs(plan)
    scale = tiny_experiment / "scale" / "tiny.yaml"
    scale.write_text(scale.read_text().replace("n_layers: 4", "n_layers: 6"))  # edited after launch
    assert plan_experiment("specx", []).runs[0].model.n_layers != plan.runs[0].model.n_layers
    planned = next(r for r in plan.runs if r.config.variant == "hourglass")
    result = TrainJob(planned.dir)()
    assert result["run_key"] == planned.key
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("specx").experiment_id], filter_string=TRAINING_RUNS)
    assert json.loads(run.data.params["resolved.ffn_widths"]) == planned.model.ffn.widths
    assert run.data.params["resolved.n_layers"] == str(planned.model.n_layers)
    assert run.data.tags["study.run_key"] == planned.key


@pytest.mark.integration
def test_status_and_report_find_a_launch_without_its_overrides(tiny_experiment, workdir, capsys):
    from study.launch.status import experiment_status
    from study.launch.submit import launch

    launch("specx", ["cluster=local", "train.log_interval=3", "train.lr=2e-3"], echo=lambda m: None)
    rows = experiment_status("specx", [])
    assert [r.verdict for r in rows] == ["finished"] * 4
    assert {r.key for r in rows} == {r.key for r in plan_experiment("specx", ["train.lr=2e-3"]).runs}
    capsys.readouterr()
    assert main(["report", "specx", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {r["n"] for r in result["results"] if r["metric"] == "val/loss"} == {2}
    # a relaunch whose overrides change identities names the new runs and trains nothing
    assert main(["launch", "specx", "cluster=local", "train.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "--new-runs" in err and "hourglass-tiny-s0" in err
    assert experiment_status("specx", []) == rows
    # the same launch again submits nothing
    seen = []
    assert launch("specx", ["cluster=local", "train.lr=2e-3"], echo=seen.append) == []
    assert "nothing to submit" in seen[-1]


def test_the_role_is_declared_checked_and_refused_under_its_old_name():
    """`role` holds one of `Role`'s values (calibrate included); a config built in code with another is refused by
    name, and an override saying `stage` (the field's former name) is refused naming `role`."""
    from dataclasses import replace

    from study.config.compose import compose
    from study.config.run import Role, RunConfig
    from study.config.validate import validate_run

    assert [r.value for r in Role] == ["train", "reference", "scheduled", "tune", "calibrate", "trunk", "branch"]
    with pytest.raises(StudyError) as err:
        compose(overrides=["scale=tiny", "stage=reference"])
    assert err.value.field == "stage" and "renamed to role" in err.value.problem
    new = compose(overrides=["scale=tiny", "role=reference"])
    assert new.role == Role.reference
    assert run_key(new) == run_key(compose(overrides=["scale=tiny"]))
    validate_run(replace(new, role=Role.calibrate))
    with pytest.raises(StudyError) as err:
        validate_run(replace(RunConfig(), role="finetune"))
    assert err.value.field == "role" and "calibrate" in err.value.fix


def test_the_direct_typed_build_equals_omegaconfs_for_every_config_the_shipped_plans_compose(monkeypatch):
    """compose builds RunConfig directly where every value already has its field's type; for each distinct config
    of every shipped experiment that build equals OmegaConf's typed merge, and a value needing conversion (an int
    for a string field) is left to OmegaConf."""
    from omegaconf import OmegaConf

    from study.config import compose as composer
    from study.config.run import RunConfig
    from study.plan.planner import plan_experiment

    built = []
    direct = composer._build

    def both(cls, node):
        cfg = direct(cls, node)
        if cls is RunConfig:
            assert cfg is not None, [k for k in node if k not in composer._hints(cls)]  # never the slow path
            assert cfg == OmegaConf.to_object(OmegaConf.merge(composer.typed_defaults(), node))
            built.append(cfg)
        return cfg

    monkeypatch.setattr(composer, "_build", both)
    composer.clear_cache()
    for name in composer.group_options("experiment"):
        plan_experiment(name)
    assert len(built) > 50
    monkeypatch.setattr(composer, "_build", direct)
    assert direct(RunConfig, {"scale": 128}) is None and direct(RunConfig, {"nosuch": 1}) is None
    assert direct(RunConfig, {"train": {"lr": 1}}).train.lr == 1.0
    composer.clear_cache()
    assert composer.compose(overrides=["scale=tiny", "variant=128"]).variant == "128"
    monkeypatch.setenv("STUDY_TOKENIZER", "/somewhere/tokenizer.json")
    composer.clear_cache()
    assert composer.compose(overrides=["scale=tiny", "data=openwebtext"]).data.tokenizer == "/somewhere/tokenizer.json"
