"""Decay branches (`branches:` in an experiment file): a trunk at the stable LR and one decay branch per point, each
equal to the straight WSD run of its length; planned, keyed and priced as such."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from analysis.surface import TOKENS
from conftest import ROOT, TINY
from study.cli import main
from study.config.compose import nested
from study.config.identity import branch_key
from study.config.run import Role

BRANCHES = {"at": [0.25, 0.5, 1.0], "decay": 0.2}


def experiment(tmp_path, monkeypatch, *, steps=40, **changes) -> str:
    """A two-arm tiny experiment with branches, written into a copy of sweeps/."""
    tree = tmp_path / "sweeps"
    if not tree.exists():
        shutil.copytree(ROOT / "sweeps", tree)
    settings = dict(s.split("=", 1) for s in TINY if not s.startswith("scale="))
    common = nested({k: yaml.safe_load(v) for k, v in settings.items()})
    common["train"].update(max_steps=steps, lr_schedule="wsd", val_interval=10, ckpt_interval=10)
    spec = {"baseline": "a", "scales": ["tiny"], "seeds": [0], "branches": BRANCHES,
            "variants": {"a": {"model": "conventional"}, "b": {"model": "tapered"}}, "common": common, **changes}
    (tree / "experiment" / "branched.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    return "branched"


def test_each_run_is_planned_as_a_trunk_and_a_branch_per_point(workdir, monkeypatch):
    from study.plan.planner import plan_experiment

    plan = plan_experiment(experiment(workdir, monkeypatch))
    trunks = [r for r in plan.runs if r.role == Role.trunk]
    branches = [r for r in plan.runs if r.role == Role.branch]
    assert len(trunks) == 2 and len(branches) == 6
    for trunk in trunks:
        mine = [b for b in branches if b.trunk == trunk.key]
        # lengths are the points' fractions of 40 steps; each starts where a straight WSD run of its length decays
        assert [(b.points[0].length, b.points[0].start) for b in mine] == [(10, 8), (20, 16), (40, 32)]
        assert [b.planned.max_steps for b in mine] == [10, 20, 40]
        assert {b.planned.warmup_steps for b in mine} == {trunk.planned.warmup_steps} == {2}
        assert trunk.last_step == 32 and trunk.kept_steps == {8, 16, 32} and trunk.planned.max_steps == 40
        assert [b.key for b in mine] == [branch_key(trunk.key, a, 0.2) for a in (0.25, 0.5, 1.0)]
        assert {b.config.train.decay_fraction for b in mine} == {0.2}
        # what each trains itself: the trunk 32 steps, each branch its decay only
        per_step = trunk.planned.global_batch * trunk.config.data.seq_len
        assert trunk.tokens() == 32 * per_step and [b.tokens() for b in mine] == [2 * per_step, 4 * per_step,
                                                                                   8 * per_step]
    assert len({r.key for r in plan.runs}) == 8
    # arms share their trunks' steps and branch points: the pairing is by (scale, seed) as for straight runs
    assert {tuple((p.length, p.start) for p in t.points) for t in trunks} == {((10, 8), (20, 16), (40, 32))}


def test_the_plan_prices_trunks_and_branches_against_separate_runs(workdir, monkeypatch, capsys):
    name = experiment(workdir, monkeypatch)
    assert main(["plan", name]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # trunk 32 steps + branches 2 + 4 + 8 per run, against separate runs of 10 + 20 + 40: 46 / 70 - 1 = -34 %
    assert "2 trunks and 6 branches" in out and "(-34%)" in out



def test_the_plan_of_a_racing_experiment_states_its_expected_saving(workdir, monkeypatch, capsys):
    from study.plan.racing import expected_saving

    name = experiment(workdir, monkeypatch, seeds=[0, 1, 2, 3, 4, 5], racing=True,
                      decision={"margin": 0.01, "prior_sd": 0.004})
    assert main(["plan", name]) == 0
    out = " ".join(capsys.readouterr().out.split())
    worse = expected_saving([0.25, 0.5, 1.0], 0.2, arms=1, seeds=6, sd=0.004, alpha=0.05, margin=0.01, effect=0.02)
    assert worse > 0.05  # an arm worse by twice the margin is usually stopped early at 6 seeds
    assert f"racing saves about {worse:.0%} of them in expectation if every arm is worse by twice the margin" in out


@pytest.mark.integration
def test_the_shipped_scaling_study_is_branched_and_its_plan_states_what_racing_would_save(workdir, capsys):
    from study.plan.racing import expected_saving

    assert main(["plan", "hourglass"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "125 trunks and 375 branches" in out
    # 4 arms against conventional, 5 seeds, the experiment's margin 0.005 and prior sd 0.004
    worse = expected_saving([0.25, 0.5, 1.0], 0.2, arms=4, seeds=5, sd=0.004, alpha=0.05, margin=0.005, effect=0.01)
    none = expected_saving([0.25, 0.5, 1.0], 0.2, arms=4, seeds=5, sd=0.004, alpha=0.05, margin=0.005, effect=None)
    assert (f"racing would save (`racing: true`) about {worse:.0%} of them in expectation if every arm is worse by "
            f"twice the margin, {none:.0%} if none differs (5 seeds, sd 0.004") in out


@pytest.mark.parametrize("change,field", [
    ({"branches": {"at": [0.5, 0.5], "decay": 0.2}}, "branched.yaml: branches.at"),
    ({"branches": {"at": [], "decay": 0.2}}, "branched.yaml: branches.at"),
    ({"branches": {"at": [0.5], "decay": 1.5}}, "branched.yaml: branches.decay"),
    ({"branches": {"at": [0.5], "every": 2}}, "branched.yaml: branches.every"),
    ({"branches": {"at": [0.05, 1.0], "decay": 0.2}}, "branched.yaml: branches.at"),  # starts inside the warm-up
])
def test_a_malformed_branches_block_is_refused_naming_the_field(change, field, workdir, monkeypatch, capsys):
    name = experiment(workdir, monkeypatch, **change)
    assert main(["plan", name]) == 2
    assert f"error in `{field}`" in capsys.readouterr().err


@pytest.mark.parametrize("racing,field", [
    ({"stop": True}, "branched.yaml: racing.stop"), (3, "branched.yaml: racing"),
    ({"stop_equivalent": "yes"}, "branched.yaml: racing.stop_equivalent"),
])
def test_a_malformed_racing_block_is_refused_naming_the_field(racing, field, workdir, monkeypatch, capsys):
    name = experiment(workdir, monkeypatch, racing=racing)
    assert main(["plan", name]) == 2
    assert f"error in `{field}`" in capsys.readouterr().err


def test_racing_reads_branch_points_so_it_needs_branches(workdir, monkeypatch, capsys):
    from study.plan.experiment import load_experiment

    name = experiment(workdir, monkeypatch, racing={"stop_equivalent": True}, seeds=[0, 1])
    assert load_experiment(name).racing.stop_equivalent is True
    assert load_experiment(experiment(workdir, monkeypatch, racing=False)).racing is None
    name = experiment(workdir, monkeypatch, racing=True, branches=None)
    assert main(["plan", name]) == 2
    assert "error in `branched.yaml: racing`" in capsys.readouterr().err


def test_branches_need_a_stable_lr_to_branch_from(workdir, monkeypatch, capsys):
    name = experiment(workdir, monkeypatch)
    assert main(["plan", name, "train.lr_schedule=cosine"]) == 2
    assert "error in `train.lr_schedule`" in capsys.readouterr().err


@pytest.mark.integration
def test_a_branch_equals_the_straight_wsd_run_of_its_length(workdir, monkeypatch):
    """The branch from step s = 16 with decay 0.2 is the straight WSD run of 20 steps: every training loss and the
    final validation loss agree to fp32 round-off (they are the same arithmetic: batches are a function of (seed,
    step), the LR of the step, and the branch resumes the trunk's optimizer and RNG)."""
    from study.plan.planner import plan_experiment, select_run
    from study.train.loop import train

    plan = plan_experiment(experiment(workdir, monkeypatch, steps=40))
    trunk = next(r for r in plan.runs if r.role == Role.trunk and r.config.variant == "a")
    branch = next(r for r in plan.runs if r.trunk == trunk.key and r.points[0].at == 0.5)
    done = train(trunk)
    assert done.status == "FINISHED" and done.step == 32
    from study.train.checkpoint import complete_checkpoints

    kept = [int(p.name[5:]) for p in complete_checkpoints(trunk.run_dir.path)]
    assert {8, 16, 32} <= set(kept)  # branch starts survive keep_last pruning
    out = train(branch)
    assert out.status == "FINISHED" and min(out.losses) == 17 and max(out.losses) == 20
    straight = select_run([*TINY, "experiment=unit", "train.lr_schedule=wsd", "train.max_steps=20",
                           "train.decay_fraction=0.2", "paths.runs=straight"])
    assert straight.planned.lr == branch.planned.lr and straight.planned.warmup_steps == 2
    ref = train(straight)
    for step in range(17, 21):
        assert out.losses[step] == pytest.approx(ref.losses[step], rel=1e-6, abs=1e-7)
    assert out.val_loss == pytest.approx(ref.val_loss, rel=1e-6)
    # the same run's first steps are the trunk's
    for step in range(1, 17):
        assert done.losses[step] == pytest.approx(ref.losses[step], rel=1e-6, abs=1e-7)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name("branched")
    runs = {r.data.tags["study.run_key"]: r for r in client.search_runs([exp.experiment_id],
                                                                         "tags.`study.run_key` LIKE '%'")}
    b, t = runs[branch.key].data.tags, runs[trunk.key]
    assert (b["study.role"], b["study.trunk_key"], b["study.branch.step"], b["study.branch.at"]) == (
        "branch", trunk.key, "16", "0.5")
    assert b["mlflow.parentRunId"] == t.info.run_id and t.data.tags["study.role"] == "trunk"
    assert runs[branch.key].data.params["recipe.tokens"] == str(branch.planned.tokens)
    steps = [m.step for m in client.get_metric_history(runs[branch.key].info.run_id, "train/loss")]
    assert steps == list(range(17, 21))  # the branch logs its own steps, never the trunk's again


@pytest.mark.integration
def test_a_local_launch_trains_the_trunks_then_their_branches_and_a_relaunch_trains_nothing(workdir, monkeypatch,
                                                                                           capsys):
    from study.config.spec import finished_result
    from study.plan.planner import plan_experiment

    name = experiment(workdir, monkeypatch, steps=20)
    assert main(["launch", name, "cluster=local"]) == 0
    out = capsys.readouterr().out
    assert out.index("stage train:") < out.index("stage branch:")
    plan = plan_experiment(name)
    results = {r.key: finished_result(r) for r in plan.runs}
    assert all(results.values()) and len(results) == 8
    for r in plan.runs:  # every trunk stopped at its last branch start, every branch at its length
        assert results[r.key]["step"] == (16 if r.role == Role.trunk else r.points[0].length)
    assert main(["launch", name, "cluster=local"]) == 0
    assert "nothing to submit" in capsys.readouterr().out

    # one scale: the report fits L(D) per arm over its three branch ends, and says why there is no surface
    assert main(["report", name, "--out", str(workdir / "reports")]) == 0
    md = (workdir / "reports" / name / "report.md").read_text()
    assert "## Loss against tokens per arm" in md and "No L(N, D) surface" in md
    report = json.loads((workdir / "reports" / name / "report.json").read_text())
    assert report["surface"]["form"] == TOKENS
    fitted = {f["variant"]: f for f in report["surface"]["fits"]}
    assert set(fitted) == {"a", "b"} and all(f["n_points"] == 3 for f in fitted.values())
    trunk = next(r for r in plan.runs if r.role == Role.trunk)
    per_step = trunk.planned.global_batch * trunk.config.data.seq_len
    for fit in fitted.values():  # D of a branch end: every token it saw, its trunk's and its own (5 and 20 steps)
        assert fit["d_range"] == [5 * per_step, 20 * per_step] and fit["scale"] == "tiny"


@pytest.mark.integration
def test_a_rung_decided_worse_stops_that_arm_and_no_launch_trains_it_again(workdir, monkeypatch, capsys):
    """The race decides a rung once all its branches have finished: an arm whose branch endpoints are worse than the
    baseline's by far more than their spread stops there (its trunks and later branches are never submitted again,
    `study status` says why), the baseline and the undecided arm go on, and the record names the GPU-hours saved."""
    import json

    import numpy as np
    from scipy import stats

    from study.launch.racing import settle, stopped_keys, write_roster
    from study.launch.stages import Queue, to_submit
    from study.plan.planner import plan_experiment

    variants = {"a": {"model": "conventional"}, "b": {"model": "tapered"}, "c": {"model": "hourglass"}}
    name = experiment(workdir, monkeypatch, seeds=[0, 1, 2, 3], variants=variants, racing=True,
                      branches={"at": [0.5, 1.0], "decay": 0.2}, decision={"alpha": 0.05, "margin": 0.01})
    plan = plan_experiment(name)
    write_roster(plan)
    planted = {"a": 3.0, "b": 3.5, "c": 3.0}  # b worse by 0.5 nats; c no different
    noise = {0: 0.001, 1: -0.002, 2: 0.0015, 3: 0.0}
    first = [r for r in plan.runs if r.role == Role.branch and r.points[0].at == 0.5]
    for r in first:
        r.run_dir.path.mkdir(parents=True)
        loss = planted[r.config.variant] + noise[r.config.seed] * (r.config.variant != "a")
        r.run_dir.result.write_text(json.dumps({"val_loss": loss, "step": r.points[0].length, "run_key": r.key}))
    new = settle(plan.runs[0].config.paths.runs, name)
    verdicts = {v["variant"]: v for v in new}
    assert verdicts["b"]["verdict"] == "worse" and verdicts["b"]["stops"] is True
    assert verdicts["c"]["stops"] is False
    # rung 1 of 2 at t = 0.5 spends alpha x 0.5 ** 3; b's interval is the paired t interval at that alpha
    alpha = 0.05 * 0.5 ** 3
    d = np.array([0.5 + noise[s] for s in range(4)])
    half = stats.t.ppf(1 - alpha / 2, 3) * d.std(ddof=1) / 2
    assert verdicts["b"]["alpha"] == pytest.approx(alpha)
    assert (verdicts["b"]["ci_low"], verdicts["b"]["ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half))
    stopped = stopped_keys(plan)
    b_runs = {r.key for r in plan.runs if r.config.variant == "b" and (r.role == Role.trunk or r.points[0].at > 0.5)}
    assert set(stopped) == b_runs and all("stopped by racing at branch point 0.5: worse" in w for w in stopped.values())
    _, train, _, _ = to_submit(plan, Queue(plan))
    # b's first-rung branches (finished here without MLflow) may be mirrored; none of what the stop covers trains
    assert not {r.key for r in train} & b_runs
    assert {r.key for r in train if r.role == Role.trunk} == {r.key for r in plan.runs if r.role == Role.trunk
                                                                and r.config.variant != "b"}
    assert settle(plan.runs[0].config.paths.runs, name) == []  # a rung is decided once
    monkeypatch.setenv("COLUMNS", "400")  # the reason column unwrapped, whatever terminal runs the tests
    assert main(["status", name]) == 0
    assert "stopped (stopped by racing" in " ".join(capsys.readouterr().out.split())
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name(name).experiment_id], "tags.`study.role` = 'racing'")[0]
    # the record's artifact is named apart from the roster, `_launch/racing.json`
    record = json.loads((Path(run.info.artifact_uri.removeprefix("file://")) / "race_record.json").read_text())
    # b's four seeds no longer train the trunk past step 16 (less the stretch beside the rung's branch) nor the
    # branch at 1.0: per seed, trunk 32 - 16 = 16 steps - the rung's 4-step tail = 12, plus the 8-step branch
    trunk = next(r for r in plan.runs if r.role == Role.trunk and r.config.variant == "b")
    per_step = trunk.gpu_hours() / 32
    assert record["stops"][0]["variant"] == "b"
    assert record["stops"][0]["gpu_hours_saved"] == pytest.approx(4 * (12 + 8) * per_step, rel=1e-6)
    from analysis.document import race_blocks
    from analysis.racing import read_race
    from analysis.render import to_markdown

    text = to_markdown(race_blocks(read_race(client, client.get_experiment_by_name(name).experiment_id), "val/loss"))
    assert "1 arm(s) stopped" in text and "| b | tiny | 0.5 | worse | 4 |" in text
    # what the report reads (analysis.report.analyse: read_race) is what the launch wrote
    assert read_race(client, client.get_experiment_by_name(name).experiment_id) == record


@pytest.mark.parametrize("where", ["command line", "at"])
def test_a_decay_fraction_that_contradicts_the_branches_is_refused_naming_the_field(where, workdir, monkeypatch,
                                                                                    capsys):
    """The branch points are placed by branches.decay, the trunk's and each branch's LR by train.decay_fraction: a
    run at 0.5 with branches at 0.2 would decay its trunk from step 20 of 40, and no branch would be the straight
    WSD run of its length. It is refused before anything is written or submitted; the branches' own value is no
    contradiction."""
    def argv_for(decay: float) -> list[str]:
        if where == "at":
            return [experiment(workdir, monkeypatch, at={"tiny": {"train.decay_fraction": decay}})]
        return [experiment(workdir, monkeypatch), f"train.decay_fraction={decay}"]

    for command in (["plan"], ["launch", "cluster=local"]):
        argv = argv_for(0.5)
        assert main([command[0], argv[0], *command[1:], *argv[1:]]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "error in `train.decay_fraction`" in err and "is 0.5 for variant a at scale tiny" in err
        assert "decays each branch over 0.2" in err
        assert "drop train.decay_fraction from the command line and from the experiment's at: and variants" in err
    assert not (workdir / "runs").exists()
    assert main(["plan", *argv_for(0.2)]) == 0


def complete_checkpoint(run, step: int) -> None:
    """A complete checkpoint of `run` at `step` as study.train.checkpoint counts one (its files, no weights)."""
    folder = run.run_dir.checkpoints / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    (folder / "train_state.json").write_text(json.dumps({"step": step, "run_key": run.key}))


def test_a_branch_whose_trunk_lost_its_start_is_not_submitted_and_the_launch_names_the_trunks_restart(
        workdir, monkeypatch, capsys):
    """The trunk finished (result.json, checkpoints at 4 and 16) but its checkpoint at step 8 is gone: no job of the
    trunk writes it again (each resumes at its latest), so the branch at 0.5 would fail at every launch. It is not
    submitted, the launch and status say why and name the restart of the trunk; after that restart the trunk trains
    again and the branch waits for it."""
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment
    from study.train.restart import restart_idle

    name = experiment(workdir, monkeypatch, steps=20, variants={"a": {"model": "conventional"}})
    plan = plan_experiment(name, ["cluster=local"])
    trunk = next(r for r in plan.runs if r.role == Role.trunk)
    lost = next(r for r in plan.runs if r.role == Role.branch and r.points[0].start == 8)
    trunk.run_dir.path.mkdir(parents=True)
    trunk.run_dir.result.write_text(json.dumps({"val_loss": 4.0, "step": 16, "run_key": trunk.key}))
    for step in (4, 16):
        complete_checkpoint(trunk, step)
    lines: list[str] = []
    stages = launch(name, ["cluster=local"], dry_run=True, echo=lines.append)
    branch_stage = [r.key for s in stages if s.name == "branch" for r in s.runs]
    assert branch_stage == [r.key for r in plan.runs if r.role == Role.branch and r is not lost]
    fix = f"`study launch {name} cluster=local --restart {trunk.key}`"
    assert [line for line in lines if lost.key in line] == [
        f"not submitted: {lost.name} ({lost.key}): its trunk {trunk.key} trained past step 8 and no longer holds its "
        f"checkpoint there, which the branch starts from: {fix} trains the trunk again from step 0, and the branch "
        "from that checkpoint once it is written"]
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["status", name, "cluster=local"]) == 0
    assert f"blocked (no job can train it, so `study launch` submits none: its trunk {trunk.key} trained past step 8" \
        in " ".join(capsys.readouterr().out.split())

    restart_idle(trunk)  # what the named command does before it launches
    stages = launch(name, ["cluster=local"], dry_run=True, echo=lines.append)
    assert trunk.key in [r.key for s in stages if s.name == "train" for r in s.runs]
    assert lost.key in [r.key for s in stages if s.name == "branch" for r in s.runs]


@pytest.mark.integration
def test_a_race_arm_whose_trunk_diverged_has_no_branch_submitted_from_a_start_it_never_wrote(workdir, monkeypatch):
    """Arm b's trunk diverges at step 6 (real training, the loss made NaN): it never writes its checkpoints at steps
    8 and 16, and resumed it diverges again, so its branches there are never submitted, by the launch nor by a local
    launch's branch stage, and the launch says why. Its branch at step 4 starts from a checkpoint the trunk validated
    before it diverged, and trains."""
    from study.launch.kinds import JobKind
    from study.launch.local import run_local
    from study.launch.scheduler import journal
    from study.launch.stages import Stage
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment
    from study.train.loop import train

    name = experiment(workdir, monkeypatch, steps=20, racing=True, seeds=[0, 1], variants={
        "a": {"model": "conventional"}, "b": {"model": "tapered", "set": {"faults.nan_at_step": 6}}})
    plan = plan_experiment(name, ["cluster=local"])
    trunk = next(r for r in plan.runs if r.role == Role.trunk and r.config.variant == "b" and r.config.seed == 0)
    outcome = train(trunk)
    assert (outcome.status, outcome.reason) == ("FAILED", "training loss is nan at step 6")
    mine = {r.points[0].start: r for r in plan.runs if r.trunk == trunk.key}
    lines: list[str] = []
    stages = launch(name, ["cluster=local"], dry_run=True, echo=lines.append)
    branch_stage = {r.key for s in stages if s.name == "branch" for r in s.runs}
    assert mine[4].key in branch_stage and not branch_stage & {mine[8].key, mine[16].key}
    assert trunk.key in {r.key for s in stages if s.name == "train" for r in s.runs}  # a failed run is resubmitted
    for step in (8, 16):
        said = [line for line in lines if mine[step].key in line]
        assert said == [f"not submitted: {mine[step].name} ({mine[step].key}): its trunk {trunk.key} diverged "
                        f"(training loss is nan at step 6) before writing its checkpoint at step {step}, which the "
                        "branch starts from, and resumed it diverges again: lower the arm's LR (train.lr; new runs), "
                        f"or, if a fault made it diverge, `study launch {name} cluster=local --restart {trunk.key}` "
                        "trains the trunk again"]
    # a local launch's branch stage asks again before each batch: its trunks trained (or failed) in the same launch
    lines.clear()
    run_local(plan, [Stage(JobKind.branch, [mine[8], mine[16]])], lines.append)
    assert not {mine[8].key, mine[16].key} & set(journal(plan.runs[0].config.paths.runs, name))
    assert sum(line.startswith("not submitted:") and "diverged (training loss is nan at step 6)" in line
               for line in lines) == 2
