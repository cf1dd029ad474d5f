"""The tuning record is a result: it names the tune runs it was computed from, is used only while they are the tune
runs the plan holds, is refused when damaged or edited by hand, and never re-specifies a finished run; a diverged tune
point is a result (the worst loss), and a relaunch after tuning always ends."""

from __future__ import annotations

import json
import math

import pytest

from study.cli import main
from study.config.run import Role
from study.plan.tune import Point, choose

EXPERIMENT = {
    "description": "two arms, a three-point LR grid",
    "baseline": "a",
    "scales": ["tiny"],
    "seeds": [0],
    "variants": {"a": {"model": "conventional"}, "b": {"model": "hourglass", "at": {"tiny": {"model.n_layers": 1}}}},
    "tune": {"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [0], "extend": 1},
    "common": {
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "ffn": {"width": 128}, "max_seq_len": 32,
                  "vocab_size": 512},
        "data": {"seq_len": 32, "max_docs": 1500, "vocab_size": 512, "val_fraction": 0.05},
        "train": {"max_steps": 8, "ckpt_interval": 8, "val_interval": 8, "micro_batch": 4, "val_batches": 1,
                  "warmup_steps": 2},
        "budget": {"tolerance": 1e-2},
    },
}


def sweeps(workdir, monkeypatch, **changes) -> str:
    from slurm_helpers import private_sweeps

    monkeypatch.setenv("STUDY_SWEEPS", str(private_sweeps(workdir, "rec", **{**EXPERIMENT, **changes})))
    return "rec"


def loss_at(multiple: float, best: float = 1.2) -> float:
    """A loss curve in log LR with its minimum at `best`."""
    return round(3.0 + 0.1 * math.log(multiple / best) ** 2, 6)


def settle(plan, variant: str | None = None, diverge: tuple[float, ...] = (), curve=loss_at) -> dict[str, float]:
    """Each unsettled tune run's result as its trainer writes it: its final loss, or its divergence."""
    out = {}
    for r in plan.runs:
        if r.role != Role.tune or (variant and r.config.variant != variant) or r.run_dir.result.exists():
            continue
        r.run_dir.path.mkdir(parents=True, exist_ok=True)
        m = r.tuned.multiple
        result = {"val_loss": None if m in diverge else curve(m), "step": r.planned.max_steps, "run_key": r.key}
        if m in diverge:
            result["diverged"] = f"training loss is nan at step 3 (x{m:g})"
        r.run_dir.result.write_text(json.dumps(result))
        out[r.key] = curve(m)
    return out


def decided(name: str):
    """Plan until every variant's tuning decides (points beyond an edge settle as they are added); record it."""
    from study.launch.submit import write_specs
    from study.plan.planner import plan_experiment

    for _ in range(6):
        plan = plan_experiment(name)
        if not settle(plan):
            break
    write_specs(plan, echo=lambda m: None)
    return plan_experiment(name)


def record_file(workdir, variant="a"):
    return workdir / "runs" / "rec" / "_tune" / f"{variant}.json"


def test_the_record_names_the_tune_runs_and_losses_its_choice_was_computed_from(workdir, monkeypatch):
    name = sweeps(workdir, monkeypatch)
    plan = decided(name)
    record = json.loads(record_file(workdir).read_text())
    tune = {r.key: r for r in plan.runs if r.role == Role.tune and r.config.variant == "a"}
    points = record["scales"]["tiny"]["points"]
    assert sorted(k for p in points for k in p["keys"]) == sorted(tune)
    for p in points:
        assert p["losses"] == [loss_at(p["multiple"])]
    expected = choose([Point(p["multiple"], [loss_at(p["multiple"])]) for p in points], False)
    assert record["scales"]["tiny"]["multiple"] == expected.multiple and expected.status == "interior"
    main_a = [r for r in plan.runs if r.role != Role.tune and r.config.variant == "a"]
    assert main_a and all(not r.awaits_tuning for r in main_a)
    rule_lr = next(r for r in tune.values() if r.tuned.multiple == 1.0).config.train.lr
    assert main_a[0].planned.lr == pytest.approx(expected.multiple * rule_lr, rel=1e-5)


def test_after_the_experiment_changes_what_tune_runs_train_the_old_record_is_not_used_and_main_runs_wait(
        workdir, monkeypatch, capsys):
    from study.plan.planner import plan_experiment

    name = sweeps(workdir, monkeypatch)
    before = decided(name)
    old_main = {r.name: r.key for r in before.runs if r.role != Role.tune}
    # the tune runs now train for more steps: other tune runs, so the record is another tuning's
    changed = {**EXPERIMENT["common"], "train": {**EXPERIMENT["common"]["train"], "max_steps": 12}}
    sweeps(workdir, monkeypatch, common=changed)
    plan = plan_experiment(name)
    held = [r for r in plan.runs if r.role != Role.tune]
    assert all(r.awaits_tuning for r in held)
    assert all("computed from other tune runs" in r.pending for r in held)
    assert not set(old_main.values()) & {r.key for r in held}  # the new tuning's main runs are new runs
    assert main(["plan", name]) == 0
    assert "computed from other tune runs" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("edit,problem", [
    (lambda r: r["scales"]["tiny"].update(multiple=100.0), "does not follow from its points"),
    (lambda r: r["scales"]["tiny"].update(multiple=float("nan")), "positive finite"),
    (lambda r: r["scales"]["tiny"].update(multiple=-1), "positive finite"),
    (lambda r: r["scales"]["tiny"].pop("status"), "must hold exactly"),
    (lambda r: r.update(colour="red"), "its fields are"),
    (lambda r: r["scales"].update({"113M": r["scales"]["tiny"]}), "records scales"),
    (lambda r: r["scales"]["tiny"]["points"][0].update(losses=[1.0]), "whose result.json says"),
    (lambda r: r["scales"]["tiny"].update(status="edge"), "does not follow from its points"),
    (lambda r: r["scales"]["tiny"]["points"][0].update(losses=["x"]), "neither a finite number"),
])
def test_a_record_damaged_or_edited_by_hand_is_refused_naming_the_file_and_nothing_is_rewritten(
        workdir, monkeypatch, capsys, edit, problem):
    name = sweeps(workdir, monkeypatch)
    plan = decided(name)
    path = record_file(workdir)
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    main_a = next(r for r in plan.runs if r.role != Role.tune and r.config.variant == "a")
    spec_before = main_a.run_dir.spec.read_bytes()
    for argv in (["plan", name], ["launch", name, "cluster=local"], ["status", name]):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        shown = path.relative_to(workdir)  # as paths.runs names it
        assert f"`{shown}`" in err and problem in err and f"delete {shown}" in err
    assert main_a.run_dir.spec.read_bytes() == spec_before
    assert not (main_a.run_dir.path / "checkpoints").exists()


@pytest.mark.integration
def test_a_record_that_is_not_json_is_refused_and_deleting_it_recomputes_the_same_choice(workdir, monkeypatch, capsys):
    name = sweeps(workdir, monkeypatch)
    decided(name)
    path = record_file(workdir)
    good = json.loads(path.read_text())
    path.write_text("{not json")
    assert main(["plan", name]) == 2
    assert "does not read as JSON" in capsys.readouterr().err
    path.unlink()
    decided(name)
    assert json.loads(path.read_text()) == good


def test_a_diverged_tune_point_counts_as_the_worst_loss_and_the_choice_goes_on(workdir, monkeypatch):
    name = sweeps(workdir, monkeypatch)
    from study.plan.planner import plan_experiment

    settle(plan_experiment(name), diverge=(2.0,))
    plan = decided(name)
    choice = plan.tunings["a"].choices["tiny"]
    # x2 diverged: the best finite point x1 has a diverged neighbour, so it is taken itself
    assert choice.multiple == 1.0 and choice.best == 1.0
    record = json.loads(record_file(workdir).read_text())
    assert [p["losses"] for p in record["scales"]["tiny"]["points"]][-1] == ["diverged"]
    assert all(not r.awaits_tuning for r in plan.runs if r.role != Role.tune)


@pytest.mark.integration
def test_a_grid_that_diverges_everywhere_holds_the_main_runs_with_one_clear_reason(workdir, monkeypatch, capsys):
    name = sweeps(workdir, monkeypatch, tune={**EXPERIMENT["tune"], "extend": 1})
    from study.plan.planner import plan_experiment

    for _ in range(4):
        settle(plan_experiment(name), variant="b", diverge=(0.25, 0.5, 1.0, 2.0))
        settle(plan_experiment(name), variant="a")
    plan = plan_experiment(name)
    b = [r for r in plan.runs if r.role != Role.tune and r.config.variant == "b"]
    assert all(r.awaits_tuning and "every tune point of b at tiny diverged (x0.25 to x2)" in r.pending
               and "lower tune.lr" in r.pending for r in b)
    lines: list[str] = []
    from study.launch.submit import launch

    launch(name, ["cluster=local"], dry_run=True, echo=lines.append)
    assert any("tuning of b: every tune point of b at tiny diverged" in line for line in lines)
    # (its tune runs' results were written here without MLflow: a launch would only bring MLflow their results)


@pytest.mark.integration
def test_a_diverging_tune_run_settles_as_diverged_and_a_relaunch_trains_nothing_more(workdir, monkeypatch):
    """Real training: every tune point of `b` diverges (loss NaN injected at step 3); its runs settle with the
    reason, MLflow calls them FAILED, and the launch ends; run again, it submits nothing."""
    import mlflow

    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    name = sweeps(workdir, monkeypatch, tune={"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [0], "extend": 0},
                  variants={"a": {"model": "conventional"},
                            "b": {"model": "hourglass", "set": {"faults.nan_at_step": 3},
                                  "at": {"tiny": {"model.n_layers": 1}}}},
                  common={**EXPERIMENT["common"], "eval": {"after_train": False}})
    lines: list[str] = []
    launch(name, ["cluster=local"], echo=lines.append)
    plan = plan_experiment(name)
    b_tune = [r for r in plan.runs if r.role == Role.tune and r.config.variant == "b"]
    for r in b_tune:
        result = json.loads(r.run_dir.result.read_text())
        assert result["val_loss"] is None and result["diverged"] == "training loss is nan at step 3"
        assert result["step"] == 3
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    runs = {r.data.tags["study.run_key"]: r for r in mlflow.search_runs(
        experiment_names=[name], output_format="list", filter_string="tags.`study.run_key` LIKE '%'")}
    assert {runs[r.key].info.status for r in b_tune} == {"FAILED"}
    a_main = [r for r in plan.runs if r.role != Role.tune and r.config.variant == "a"]
    assert all(r.run_dir.result.exists() for r in a_main)  # the other arm's tuning decided and its runs trained
    assert any("every tune point of b at tiny diverged" in line for line in lines)
    again: list[str] = []
    assert launch(name, ["cluster=local"], echo=again.append) == []
    assert any("every tune point of b" in line for line in again)
    from study.launch.status import experiment_status

    words = {r.key: r.verdict for r in experiment_status(name, [])}
    assert {words[r.key].split(" (")[0] for r in b_tune} == {"diverged"}
    assert {words[r.key] for r in plan.runs if r.role != Role.tune and r.config.variant == "b"} == {
        "waiting for its tuning"}


def test_a_relaunch_after_tuning_never_submits_a_tune_run_it_already_tried(workdir, monkeypatch):
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    name = sweeps(workdir, monkeypatch)
    plan = plan_experiment(name)
    tried = frozenset(r.key for r in plan.runs if r.role == Role.tune and r.config.variant == "b")
    lines: list[str] = []
    stages = launch(name, ["cluster=local"], dry_run=True, echo=lines.append, tried=tried)
    tune = next(s for s in stages if s.name == "tune")
    assert {r.config.variant for r in tune.runs} == {"a"}
    named = [line for line in lines if line.startswith("not submitted again: tune run b-tiny-s0")]
    assert len(named) == len(tried) and all("it left no result" in line for line in named)


def test_a_finished_main_run_keeps_the_lr_it_trained_at_and_a_new_choice_is_named(workdir, monkeypatch):
    from study.launch.submit import write_specs

    name = sweeps(workdir, monkeypatch)
    plan = decided(name)
    run = next(r for r in plan.runs if r.role != Role.tune and r.config.variant == "a")
    run.run_dir.result.write_text(json.dumps({"val_loss": 3.1, "step": run.planned.max_steps, "run_key": run.key}))
    trained = run.run_dir.spec.read_bytes()
    # a tune run's result changes (trained again) and the record is deleted: the choice is made anew
    tune = next(r for r in plan.runs if r.role == Role.tune and r.config.variant == "a" and r.tuned.multiple == 2.0)
    tune.run_dir.result.write_text(json.dumps({"val_loss": 2.5, "step": 8, "run_key": tune.key}))
    record_file(workdir).unlink()
    from study.plan.planner import plan_experiment

    again = plan_experiment(name)
    now = next(r for r in again.runs if r.key == run.key)
    assert now.planned.lr != run.planned.lr
    lines: list[str] = []
    write_specs(again, echo=lines.append)
    assert run.run_dir.spec.read_bytes() == trained
    said = [line for line in lines if run.key in line]
    assert len(said) == 1 and "kept as trained" in said[0] and f"--restart {run.key}" in said[0]


def test_a_tune_folder_that_is_a_symbolic_link_is_refused_and_nothing_is_written_through_it(
        workdir, monkeypatch, capsys, tmp_path_factory):
    name = sweeps(workdir, monkeypatch)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (workdir / "runs" / "rec").mkdir(parents=True)
    (workdir / "runs" / "rec" / "_tune").symlink_to(elsewhere)
    assert main(["plan", name]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "_tune" in err and "symbolic link" in err
    assert list(elsewhere.iterdir()) == []


def test_the_dry_run_shows_the_held_main_runs_and_the_relaunch(workdir, monkeypatch):
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    name = sweeps(workdir, monkeypatch)
    held = [r for r in plan_experiment(name).runs if r.role != Role.tune]
    lines: list[str] = []
    launch(name, ["cluster=local"], dry_run=True, echo=lines.append)
    assert f"held: {len(held)} main runs wait for their variant's tuning" in " ".join(lines)
    for r in held:
        assert any(line.startswith(f"  {r.key}  {r.name}: waits for the tuning of") for line in lines)
    assert any(line.startswith("stage relaunch:") for line in lines)


def test_study_train_of_a_run_waiting_for_its_tuning_says_so(workdir, monkeypatch, capsys):
    name = sweeps(workdir, monkeypatch)
    assert main(["train", f"experiment={name}", "variant=a", "scale=tiny", "seed=0"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "tuning chooses" in err and "geometry" not in err


def test_a_record_whose_tune_results_are_gone_is_not_used_and_the_main_runs_wait_for_the_tune_runs(
        workdir, monkeypatch, capsys):
    """The record's losses are checked against its tune runs' results, so a record whose results are gone cannot be
    checked: edited consistently (losses and choice agreeing, the optimum moved to x1.35) it would train every main
    run at another LR under the same key. It is not used: the main runs wait and the tune runs train again, whose
    results then show the edit."""
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    name = sweeps(workdir, monkeypatch)
    plan = decided(name)
    main_a = [r for r in plan.runs if r.role != Role.tune and r.config.variant == "a"]
    tune_a = [r for r in plan.runs if r.role == Role.tune and r.config.variant == "a"]
    path = record_file(workdir)
    record = json.loads(path.read_text())
    edited = record["scales"]["tiny"]
    for p in edited["points"]:
        p["losses"] = [loss_at(p["multiple"], best=1.35)]
    forged = choose([Point(p["multiple"], p["losses"]) for p in edited["points"]], False)
    edited.update(multiple=forged.multiple, best=forged.best, status=forged.status)
    assert forged.multiple != plan.tunings["a"].choices["tiny"].multiple
    path.write_text(json.dumps(record))
    for r in tune_a:
        r.run_dir.result.unlink()

    again = plan_experiment(name)
    waiting = [r for r in again.runs if r.role != Role.tune and r.config.variant == "a"]
    assert [r.key for r in waiting] == [r.key for r in main_a] and all(r.awaits_tuning for r in waiting)
    assert all("names tune runs whose results are gone" in r.pending for r in waiting)
    lines: list[str] = []
    stages = launch(name, ["cluster=local"], dry_run=True, echo=lines.append)
    submitted = {r.key for s in stages for r in s.runs}
    assert {r.key for r in tune_a} <= submitted and not submitted & {r.key for r in main_a}
    assert any(line.startswith("tuning of a:") and "results are gone" in line for line in lines)
    # trained again, the tune runs give their own losses back: the edit shows, and is refused naming the file
    settle(again, variant="a")
    assert main(["plan", name]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"`{path.relative_to(workdir)}`" in err and "whose result.json says" in err
    path.unlink()  # as the refusal says: the choice is recomputed from the results, and recorded
    redone = decided(name)
    assert redone.tunings["a"].choices["tiny"].multiple == plan.tunings["a"].choices["tiny"].multiple
    assert json.loads(path.read_text())["scales"]["tiny"]["multiple"] == plan.tunings["a"].choices["tiny"].multiple
    assert all(not r.awaits_tuning for r in redone.runs if r.role != Role.tune)


def test_a_main_run_with_a_checkpoint_keeps_the_lr_it_started_at_when_its_tuning_is_recomputed(workdir, monkeypatch):
    """A main run that has trained some steps resumes at the LR it trained them at: its run.json is kept, and the
    launch names the run and the command that trains it again at the plan's LR."""
    from study.launch.submit import write_specs
    from study.plan.planner import plan_experiment

    name = sweeps(workdir, monkeypatch)
    plan = decided(name)
    run = next(r for r in plan.runs if r.role != Role.tune and r.config.variant == "a")
    step = run.run_dir.checkpoints / "step_00000004"  # a complete checkpoint, as study.train.checkpoint counts one
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "train_state.json").write_text("{}")
    trained = run.run_dir.spec.read_bytes()
    tune = next(r for r in plan.runs if r.role == Role.tune and r.config.variant == "a")
    tune.run_dir.result.unlink()  # its tuning now waits for that tune run again
    lines: list[str] = []
    write_specs(plan_experiment(name), echo=lines.append)
    assert run.run_dir.spec.read_bytes() == trained
    said = [line for line in lines if run.key in line]
    assert len(said) == 1 and f"{run.name} ({run.key}) trained at peak LR {run.planned.lr:.6g}" in said[0]
    assert "the plan now waits for its tuning: kept as trained" in said[0]
    assert f"`study launch {name} --restart {run.key}`" in said[0]
