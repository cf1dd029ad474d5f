"""Settings are done as written or refused: never dropped in silence, and a refusal names the field that was set.
A local launch of several ranks, racing that no seed count lets decide, seeds for a scale the experiment does not
have; a cluster layout that cannot split a step's batch, tune multiples or scales that plan one run twice; and
`python -m study.train`'s bad input, refused as `study train` refuses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from study.cli import main

TWO_ARMS = {"baseline": "a", "scales": ["tiny"], "seeds": [0, 1],
            "variants": {"a": {"model": "conventional"}, "b": {"model": "tapered"}}}
BRANCHED = {**TWO_ARMS, "branches": {"at": [0.5, 1.0], "decay": 0.2}, "decision": {"margin": 0.01, "prior_sd": 0.004},
            "common": {"train": {"max_steps": 40, "warmup_steps": 2, "lr_schedule": "wsd"}}}


@pytest.fixture
def tree(workdir, tmp_path_factory, monkeypatch):
    """A copy of sweeps/ the test writes experiment files (and scale presets) into, beside its working directory."""
    tree = tmp_path_factory.mktemp("tree") / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    return tree


def write(tree, name: str, spec: dict) -> str:
    (tree / "experiment" / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return name


def refusal(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def written(workdir) -> list[str]:
    """What a command left in the working directory besides the empty store the fixture made."""
    return sorted(p.name for p in workdir.iterdir() if p.name != "mlflow.db")


@pytest.mark.parametrize("override,field,value,ranks", [
    ("cluster.nodes=2", "cluster.nodes", 2, 2),
    ("cluster.tasks_per_node=2", "cluster.tasks_per_node", 2, 2),
    ("cluster.gpus_per_node=4", "cluster.gpus_per_node", 4, 4),
])
def test_a_local_launch_of_several_ranks_is_refused_naming_the_field_before_anything_is_written(
        override, field, value, ranks, workdir, capsys):
    """The local launcher runs each run as one process: 2 nodes (or tasks, or GPUs as ranks) would train on one
    rank while the plan split the batch for more, a second task only waiting on the lease."""
    for argv in (["launch", "demo", override, "--dry-run"], ["launch", "demo", override],
                 ["calibrate", "demo", override]):
        assert main(argv) == 2
        assert refusal(capsys) == (
            f"study {argv[0]}: error in `{field}`: is {value}, and a local launch trains each run as one process on "
            f"one rank (the plan splits each step over {ranks}). Fix: set {field}=1 for a local launch; to train one "
            f"run on {ranks} local ranks use `study train --nproc {ranks} experiment=... variant=... scale=... "
            "seed=...`, or launch on SLURM (cluster=slurm)")
        assert written(workdir) == []  # no spec, manifest, journal or job
    from study.config.cluster import ClusterConfig
    from study.launch.local import check_local_layout

    check_local_layout(ClusterConfig())  # one rank: launched as planned
    check_local_layout(ClusterConfig(gpus_per_node=1))


@pytest.mark.parametrize("seeds,scale,count", [([0], "tiny", 1), ({"tiny": [0], "113M": [0, 1]}, "tiny", 1)])
def test_racing_that_one_seed_can_never_decide_is_refused_naming_racing_and_the_fix(seeds, scale, count, tree,
                                                                                      capsys):
    from study.plan.experiment import load_experiment

    scales = ["tiny"] if isinstance(seeds, list) else list(seeds)
    name = write(tree, "raced", {**BRANCHED, "scales": scales, "seeds": seeds, "racing": True})
    assert main(["plan", name]) == 2
    assert refusal(capsys) == (
        f"study plan: error in `raced.yaml: racing`: stops an arm decided at a branch point, and a paired test needs "
        f"2 seeds: scale {scale} has {count} (seeds: [0]), so racing could never stop an arm there. Fix: list 2 or "
        "more seeds for every scale (e.g. seeds: [0, 1, 2]), or set racing: false")
    assert load_experiment(write(tree, "raced", {**BRANCHED, "racing": True})).racing is not None  # 2 seeds race


def test_the_plan_of_a_branched_experiment_with_one_seed_says_racing_would_stop_nothing(tree, capsys):
    """It stated an expected saving by a simulation that cannot test one pair (the plan ended in a traceback)."""
    name = write(tree, "one_seed", {**BRANCHED, "seeds": [0]})
    assert main(["plan", name]) == 0
    assert "racing would stop no arm: a scale has 1 seed, and a paired test needs 2" in " ".join(
        capsys.readouterr().out.split())


def test_seeds_for_a_scale_the_experiment_does_not_have_are_refused_naming_it_and_the_scales(tree, capsys):
    name = write(tree, "misspelt", {**TWO_ARMS, "seeds": {"tiny": [0, 1], "tinny": [0]}})
    assert main(["plan", name]) == 2
    assert refusal(capsys) == ("study plan: error in `misspelt.yaml: seeds`: names scale tinny, which is not one of "
                               "the experiment's scales (tiny). Fix: key the seeds by tiny, or add tinny to scales")


@pytest.mark.parametrize("overrides,field,layout,fix", [
    (["cluster.nodes=100000"], "cluster.nodes", "100000 nodes x 1 task per node make 100000 ranks",
     "e.g. cluster.nodes=8, or set train.global_batch to a multiple of 100000"),
    (["cluster.gpus_per_node=100000"], "cluster.gpus_per_node", "100000 GPUs on one node make 100000 ranks",
     "e.g. cluster.gpus_per_node=8, or set train.global_batch to a multiple of 100000"),
    (["cluster.nodes=2", "cluster.gpus_per_node=8"], "cluster.nodes", "2 nodes x 8 GPUs per node make 16 ranks",
     "e.g. cluster.nodes=1, or set train.global_batch to a multiple of 16"),
])
def test_more_ranks_than_a_step_has_sequences_is_refused_naming_the_layout_not_grad_accum(
        overrides, field, layout, fix, tree, capsys):
    """The demo's step is train.micro_batch 8 x train.grad_accum 1 = 8 sequences; the layout set is what cannot
    split them (it was blamed on train.grad_accum)."""
    assert main(["plan", "demo", *overrides]) == 2
    assert refusal(capsys) == (
        f"study plan: error in `{field}`: {layout}, and a step's 8 sequences (train.micro_batch 8 x train.grad_accum "
        f"1) cannot give each rank one. Fix: use a layout whose ranks divide 8, {fix}")
    assert main(["plan", "demo", "cluster.tasks_per_node=3"]) == 2
    assert "error in `cluster.tasks_per_node`: 3 tasks on one node make 3 ranks, and a step's 8 sequences" in \
        refusal(capsys)
    assert main(["plan", "demo", "train.global_batch=9", "cluster.tasks_per_node=2"]) == 2  # the batch set: named
    assert "error in `train.global_batch`: 9 sequences do not split evenly over 2 ranks" in refusal(capsys)


def test_tune_multiples_or_scales_that_plan_one_run_twice_are_refused_naming_the_tune_field(tree, capsys):
    shutil.copy(tree / "scale" / "tiny.yaml", tree / "scale" / "tiny2.yaml")  # the same preset under another name
    close = write(tree, "close", {**TWO_ARMS, "tune": {"lr": [1, 1.0000001, 2], "scale": "tiny", "seeds": [0]}})
    assert main(["plan", close]) == 2
    err = refusal(capsys)
    # the tiny preset's train.lr is 3e-3: x1 and x1.0000001 are both 0.003 to 6 significant digits
    assert err.startswith("study plan: error in `close.yaml: tune.lr`: a-tiny-s0-lr1 and a-tiny-s0-lr1 are the same "
                          "run (") and err.endswith(
        "multiples 1 and 1.0000001 give one peak LR, 0.003, at 6 significant digits. Fix: list multiples that "
        "differ in their first 6 significant digits, e.g. lr: [0.5, 1, 2]")
    twins = write(tree, "twins", {**TWO_ARMS, "tune": {"lr": [0.5, 1, 2], "scales": ["tiny", "tiny2"], "seeds": [0]}})
    assert main(["plan", twins]) == 2
    assert refusal(capsys).endswith("scales tiny and tiny2 compose the same model, data and recipe. Fix: list scales "
                                    "that differ in what they train, or drop tiny2 from tune.scales")
    assert main(["plan", write(tree, "scale_twins", {**TWO_ARMS, "scales": ["tiny", "tiny2"]})]) == 2
    assert "error in `scale_twins.yaml: scales`: a-tiny-s0 and a-tiny2-s0 are the same run" in refusal(capsys)
    assert main(["plan", write(tree, "arm_twins", {**TWO_ARMS, "variants": {"a": {"model": "conventional"},
                                                                          "b": {"model": "conventional"}}})]) == 2
    assert "error in `arm_twins.yaml: variants`" in refusal(capsys)


@pytest.mark.parametrize("argv", [["train.nosuch=1"], ["justtext"], ["experiment=demo", "variant=nosuch"],
                                  ["model=nosuch"]],
                         ids=["unknown key", "malformed override", "unknown variant", "unknown preset"])
def test_the_hydra_entry_point_refuses_bad_input_as_study_train_does(argv, workdir, capsys):
    assert main(["train", *argv]) == 2
    expected = capsys.readouterr().err.replace("study train: ", "python -m study.train: ", 1)
    out = subprocess.run([sys.executable, "-m", "study.train", *argv], cwd=workdir, capture_output=True, text=True,
                         env=os.environ, timeout=300)
    assert (out.returncode, out.stderr) == (2, expected)
    assert written(workdir) == []  # not even Hydra's outputs/ folder


def test_the_hydra_entry_point_refuses_a_bad_grid_point_before_any_job_starts(workdir):
    out = subprocess.run([sys.executable, "-m", "study.train", "-m", "seed=0,1", "train.lr=1e-3,nan", "scale=tiny"],
                         cwd=workdir, capture_output=True, text=True, env=os.environ, timeout=300)
    assert (out.returncode, out.stderr) == (2, "python -m study.train: error in `train.lr`: must be a finite number, "
                                               "got nan. Fix: use a finite value\n")
    assert written(workdir) == []  # no multirun folder, no job
