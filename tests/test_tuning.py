"""Tuning: tune runs over a grid of LR multiples train first, each variant's main runs at the LR its own
tune runs found best (the quadratic in log LR, points added beyond an edge), recorded once, keyed by the tuning."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from study.config.run import Role
from study.errors import StudyError
from study.plan.tune import EDGE, EXTENDED, INTERIOR, Point, Tuning, choose, grid_with_extensions, parse_tuning, \
    transfer

TUNING = Tuning(lr=(0.5, 1.0, 2.0), scales=("tiny",), seeds=(0, 1), extend=2)


def points(losses: dict[float, list[float | None]]) -> dict[float, Point]:
    return {m: Point(m, list(v)) for m, v in losses.items()}


def test_the_chosen_multiple_is_the_vertex_of_the_parabola_through_the_best_point_and_its_neighbours():
    grid = points({0.5: [3.0, 3.2], 1.0: [2.8, 2.9], 2.0: [2.95, 2.95]})
    pts, decided = grid_with_extensions(TUNING, grid)
    assert decided and [p.multiple for p in pts] == [0.5, 1.0, 2.0]
    choice = choose(pts, extended=False)
    a, b, _ = np.polyfit(np.log([0.5, 1.0, 2.0]), [3.1, 2.85, 2.95], 2)
    assert choice.status == INTERIOR and choice.best == 1.0
    assert choice.multiple == pytest.approx(math.exp(-b / (2 * a)), rel=1e-5)
    falling = choose(list(points({0.5: [3.0], 1.0: [2.0], 2.0: [1.0]}).values()), False)
    assert falling.status == EDGE and falling.multiple == 2.0


def test_a_best_point_at_an_edge_adds_the_next_multiple_in_that_direction_up_to_the_cap():
    grid = points({0.5: [3.0, 3.0], 1.0: [2.9, 2.9], 2.0: [2.8, 2.8]})
    pts, decided = grid_with_extensions(TUNING, grid)
    assert not decided and [p.multiple for p in pts] == [0.5, 1.0, 2.0, 4.0] and pts[-1].extension
    grid[4.0] = Point(4.0, [2.7, 2.7])
    pts, decided = grid_with_extensions(TUNING, grid)
    assert not decided and [p.multiple for p in pts][-1] == 8.0
    grid[8.0] = Point(8.0, [2.75, 2.8])  # the best is now inside: extended, and decided
    pts, decided = grid_with_extensions(TUNING, grid)
    assert decided and choose(pts, True).status == EXTENDED and choose(pts, True).best == 4.0
    grid[8.0] = Point(8.0, [2.6, 2.6])  # still at the edge with the cap reached: the edge is taken, and said
    pts, decided = grid_with_extensions(TUNING, grid)
    assert decided and choose(pts, True).status == EDGE and choose(pts, True).multiple == 8.0
    unfinished = points({0.5: [3.0, None], 1.0: [2.9, 2.9], 2.0: [2.8, 2.8]})
    assert grid_with_extensions(TUNING, unfinished)[1] is False


def test_other_scales_take_the_tuned_multiple_or_the_optimum_fitted_against_n():
    lr, how = transfer({"113M": (2.0, 0.01)}, {"113M": 113_000_000}, "906M", 0.002)
    assert lr == pytest.approx(0.004) and "tuned at 113M" in how
    lrs = {"113M": (1.0, 0.004), "440M": (1.0, 0.002)}
    budgets = {"113M": 1e8, "440M": 4e8, "1B": 1.6e9}
    lr, how = transfer(lrs, budgets, "1B", 0.5)
    assert lr == pytest.approx(0.001) and "fitted" in how  # halving per 4x N, read at 16x


@pytest.mark.parametrize("raw,field", [
    ({"lr": [1, 2], "scale": "tiny"}, "tune.lr"),
    ({"lr": [0.5, 1, -2], "scale": "tiny"}, "tune.lr"),
    ({"lr": [0.5, 1, 2]}, "tune.scale"),
    ({"lr": [0.5, 1, 2], "scale": "tiny", "scales": ["tiny", "113M"]}, "tune.scale"),
    ({"lr": [0.5, 1, 2], "scales": ["tiny"]}, "tune.scales"),
    ({"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [0, 0]}, "tune.seeds"),
    ({"lr": [0.5, 1, 2], "scale": "tiny", "extend": -1}, "tune.extend"),
    ({"lr": [0.5, 1, 2], "scale": "tiny", "steps": 3}, "tune.steps"),
    ({"lr": [0.5, 1, 2], "scale": "7T"}, "tune.scale"),
    ({"lr": [0.5, 1, 2], "scales": ["tiny", "7T"]}, "tune.scales"),
])
def test_a_malformed_tune_block_is_refused_naming_its_field(raw, field):
    from study.config.compose import group_file

    with pytest.raises(StudyError) as err:
        parse_tuning(raw, "x.yaml: tune", lambda s: group_file("scale", s))
    assert err.value.field == f"x.yaml: {field}"


TUNED = {
    "description": "two variants whose recipe LRs sit on either side of their optimum",
    "baseline": "slow",
    "scales": ["tiny"],
    "seeds": [0],
    # `slow` starts far below a good LR and `fast` far above it: slow's grid must grow upward, fast's downward
    "variants": {"slow": {"model": "conventional", "set": {"train.lr": 3.0e-4}},
                 "fast": {"model": "hourglass", "set": {"train.lr": 0.1}, "at": {"tiny": {"model.n_layers": 1}}}},
    # one point past an edge shows the grid growing (each point is a training process)
    "tune": {"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [0], "extend": 1},
    "compares": ["train.lr"],  # the recipe LR each variant starts its grid from, on purpose
    "common": {
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "ffn": {"width": 128}, "max_seq_len": 32,
                  "vocab_size": 512},
        "data": {"seq_len": 32, "max_docs": 1500, "vocab_size": 512, "val_fraction": 0.05},
        "train": {"max_steps": 20, "ckpt_interval": 20, "val_interval": 20, "micro_batch": 8, "val_batches": 2,
                  "warmup_steps": 3},
        "budget": {"tolerance": 1e-2},
    },
}


def test_plan_lists_the_tune_runs_and_holds_the_main_runs_until_their_tuning_decides(workdir, monkeypatch):
    from slurm_helpers import private_sweeps

    from study.plan.planner import plan_experiment

    monkeypatch.setenv("STUDY_SWEEPS", str(private_sweeps(workdir, "tuned", **TUNED)))
    plan = plan_experiment("tuned")
    tune = [r for r in plan.runs if r.role == Role.tune]
    assert sorted((r.config.variant, r.tuned.multiple) for r in tune) == [
        ("fast", 0.5), ("fast", 1.0), ("fast", 2.0), ("slow", 0.5), ("slow", 1.0), ("slow", 2.0)]
    assert {r.config.train.lr for r in tune if r.config.variant == "slow"} == {1.5e-4, 3e-4, 6e-4}
    main = [r for r in plan.runs if r.role != Role.tune]
    assert all(r.awaits_tuning and "tuning of" in r.pending for r in main)
    private_sweeps(workdir, "untuned", **{k: v for k, v in TUNED.items() if k != "tune"})
    untuned = {r.name: r for r in plan_experiment("untuned").runs}  # the same runs at the shared LR rule
    for r in main:  # the key includes the tuning's identity: tuned and shared-LR runs never share a key
        assert r.key != untuned[r.name].key and r.model == untuned[r.name].model
        assert r.recipe.max_steps == untuned[r.name].recipe.max_steps


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_local_launch_tunes_first_and_trains_each_variant_at_its_own_best_lr(workdir, monkeypatch):
    """Two tiny variants prefer different LRs: `slow`'s best grid point is its top edge, so points are added
    upward; each main run trains at the multiple the quadratic through its variant's tune losses gives."""
    import mlflow
    from slurm_helpers import private_sweeps

    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    monkeypatch.setenv("STUDY_SWEEPS", str(private_sweeps(workdir, "tuned", **TUNED)))
    lines: list[str] = []
    launch("tuned", ["cluster=local"], echo=lines.append)
    plan = plan_experiment("tuned")
    tune = [r for r in plan.runs if r.role == Role.tune]
    results = {r.key: json.loads(r.run_dir.result.read_text())["val_loss"] for r in tune}  # every one finished
    slow = sorted((r.tuned.multiple, results[r.key]) for r in tune if r.config.variant == "slow")
    assert [m for m, _ in slow][:4] == [0.5, 1.0, 2.0, 4.0]  # the top edge grew
    chosen = {}
    for variant in ("slow", "fast"):
        pts = [Point(m, [loss]) for m, loss in sorted((r.tuned.multiple, results[r.key]) for r in tune
                                                      if r.config.variant == variant)]
        expected = choose(pts, any(p.multiple not in (0.5, 1.0, 2.0) for p in pts))
        record = json.loads((workdir / "runs" / "tuned" / "_tune" / f"{variant}.json").read_text())
        assert record["scales"]["tiny"]["multiple"] == pytest.approx(expected.multiple)
        assert record["scales"]["tiny"]["status"] == expected.status
        chosen[variant] = expected.multiple * {"slow": 3e-4, "fast": 0.1}[variant]
    assert chosen["slow"] < chosen["fast"]
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["tuned"], output_format="list",
                              filter_string="tags.`study.run_key` LIKE '%'")
    mains = {r.data.tags["study.variant"]: r for r in runs if r.data.tags["study.role"] == "train"}
    assert set(mains) == {"slow", "fast"} and all(r.info.status == "FINISHED" for r in runs)
    for variant, run in mains.items():
        assert float(run.data.params["recipe.lr"]) == pytest.approx(chosen[variant], rel=1e-5)
        assert run.data.tags["study.lr_source"] == "tune"
    tuned_runs = [r for r in runs if r.data.tags["study.role"] == "tune"]
    assert len(tuned_runs) == len(tune)
    for r in tuned_runs:
        spec = next(t for t in tune if t.key == r.data.tags["study.run_key"])
        assert float(r.data.params["train.lr"]) == spec.config.train.lr
        assert r.data.tags["study.tune.multiple"] == f"{spec.tuned.multiple:g}"
    # the choice is recorded once: a relaunch submits nothing and keeps every main run's key and LR
    again: list[str] = []
    assert launch("tuned", ["cluster=local"], echo=again.append) == []
    assert "nothing to submit" in again[-1]


def test_seeds_an_adaptive_launch_adds_go_to_main_runs_never_to_tune_runs(workdir, monkeypatch):
    from slurm_helpers import private_sweeps

    from study.plan.planner import plan_experiment

    monkeypatch.setenv("STUDY_SWEEPS", str(private_sweeps(workdir, "tuned", **TUNED)))
    plain = plan_experiment("tuned")
    more = plan_experiment("tuned", extra_seeds={"tiny": {"slow": [3, 4]}})
    tune = sorted(r.key for r in plain.runs if r.role == Role.tune)
    assert sorted(r.key for r in more.runs if r.role == Role.tune) == tune
    assert sorted(r.config.seed for r in more.runs if r.role != Role.tune and r.config.variant == "slow") == [0, 3, 4]


COMPARISONS = ["demo", "hourglass", "hourglass_k", "scaling", "geometry", "widths", "search", "ladder"]
"""Every shipped comparison experiment: each tunes its arms' LRs (the release's reproduction alone does not)."""


def test_every_shipped_experiment_is_a_tuned_comparison_or_the_release():
    from study.config.compose import group_options

    assert sorted(group_options("experiment")) == sorted([*COMPARISONS, "hourglass_release"])


@pytest.mark.integration
@pytest.mark.parametrize("experiment", COMPARISONS)
def test_every_shipped_comparison_tunes_each_arm_at_its_smallest_scale(experiment, workdir):
    """Tune runs at the smallest scale for every arm that trains on its own widths (a geometry-scheduled arm takes its
    reference's tuning), every main run waiting for its arm's tuning; the arms still differ in their models alone."""
    from study.plan.planner import plan_experiment

    plan = plan_experiment(experiment)
    main = [r for r in plan.runs if r.role != Role.tune]
    tune = [r for r in plan.runs if r.role == Role.tune]
    smallest = min({r.config.scale: r.budget for r in main}.items(), key=lambda item: item[1])[0]
    assert plan.experiment.tuning.scales == (smallest,) and plan.experiment.compares == ()
    scheduled = {r.config.variant for r in main if r.role == Role.scheduled}
    own = {v.name for v in plan.experiment.variants} - scheduled
    assert set(plan.tunings) == own
    assert {r.config.scale for r in tune} == {smallest}
    grid = {(m, s) for m in plan.experiment.tuning.lr for s in plan.experiment.tuning.seeds}
    for variant in own:
        assert {(r.tuned.multiple, r.config.seed) for r in tune if r.config.variant == variant} == grid, variant
    assert all(r.awaits_tuning and "tuning of" in r.pending for r in main if r.role != Role.scheduled)
    reference = plan.experiment.reference[0] if plan.experiment.reference else None
    for r in (r for r in main if r.role == Role.scheduled):  # behind its reference's profile and that run's tuning
        assert r.awaits_tuning and r.tuned.record == str(plan.tunings[reference].record), r.name


def test_the_release_reproduction_trains_every_arm_at_the_releases_one_lr():
    from study.plan.planner import plan_experiment

    plan = plan_experiment("hourglass_release")
    assert plan.experiment.tuning is None and plan.tunings == {}
    assert all(r.role != Role.tune and r.tuned is None and not r.pending for r in plan.runs)
    assert {r.config.scale: r.planned.lr for r in plan.runs} == {"906M": 2.5e-4, "3B": 1.6e-4, "8B": 1.2e-4}
