"""`study launch --dry-run`: the arrays, dependencies and sbatch scripts, pinned by golden files; nothing written.

A deliberate change of the output is taken into the golden files by running, in an empty directory,
`SLURM_CONF=/absent STUDY_CACHE=/absent env -u MLFLOW_TRACKING_URI -u STUDY_TOKENIZER
study launch EXPERIMENT cluster=h100 paths.runs=/shared/runs --dry-run > tests/golden/launch_EXPERIMENT_h100.txt`.
"""

from __future__ import annotations

import pytest

from conftest import ROOT
from study.cli import main

GOLDEN = ROOT / "tests" / "golden"


@pytest.mark.parametrize("experiment,slurm_installed", [("hourglass", True), ("geometry", True), ("hourglass", False)])
def test_dry_run_prints_the_golden_arrays_and_sbatch_scripts(experiment, slurm_installed, tmp_path, monkeypatch,
                                                             capsys):
    """The same scripts where SLURM's commands are not installed (a laptop previewing a cluster launch)."""
    monkeypatch.chdir(tmp_path)
    if not slurm_installed:
        monkeypatch.setenv("PATH", str(tmp_path / "absent-bin"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))  # a dry run never asks the scheduler
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "absent-cache"))  # no shards yet: the prepare stage is shown
    assert main(["launch", experiment, "cluster=h100", "paths.runs=/shared/runs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out == (GOLDEN / f"launch_{experiment}_h100.txt").read_text()
    assert list(tmp_path.iterdir()) == []


def test_geometry_profiles_wait_for_reference_runs_and_use_one_gpu(tmp_path, monkeypatch, capsys):
    """The profile stage as a launch after tuning plans it: geometry without its `tune:` block, whose first launch
    trains only the tune runs."""
    text = dry_run_of_edited("geometry", lambda t: "\n".join(line for line in t.splitlines()
                                                               if not line.startswith("tune:")),
                             tmp_path, monkeypatch, capsys)
    profile = text.split("stage profile:")[1].split("stage scheduled:")[0]
    assert "#SBATCH --gpus-per-node=1" in profile and "#SBATCH --ntasks-per-node=1" in profile
    assert "afterok:<its reference runs in the train array>" in profile
    assert "#SBATCH --signal=USR2@300" in text and "#SBATCH --requeue" in text


def test_a_tuned_experiments_first_launch_trains_its_tune_runs_and_relaunches_itself_after_them():
    text = (GOLDEN / "launch_hourglass_h100.txt").read_text()
    prepare, rest = text.split("stage tune:")
    tune, relaunch = rest.split("stage relaunch:")
    assert prepare.startswith("stage prepare: array of 1 shard entries") and "Skylion007/openwebtext for 15 runs" in prepare
    assert "#SBATCH --gpus-per-node" not in prepare and "#SBATCH --ntasks-per-node=1" in prepare
    assert "#SBATCH --cpus-per-task=12" in prepare and "#SBATCH --job-name=hourglass-prepare" in prepare
    assert tune.startswith(" array of 15 runs, afterok on <its data in the prepare array>")
    assert "afterok:<its data in the prepare array>" in tune and "#SBATCH --gpus-per-node=8" in tune
    # every main run (5 arms x 5 scales x 5 seeds: a trunk and three branches) is listed with what it waits for
    waiting = [line for line in tune.splitlines() if "waits for the tuning of" in line]
    assert len(waiting) == 5 * 5 * 5 * 4 and "stage train:" not in text
    assert relaunch.startswith(" one CPU job (afterany on the tune array) runs `study launch` again")


@pytest.mark.parametrize("override,field", [
    ("cluster.partition='gpu; rm -rf /'", "cluster.partition"),
    ("cluster.account='lab\nrm -rf /'", "cluster.account"),
    ("cluster.setup=['module load cuda\nrm -rf /']", "cluster.setup.0"),
    ("paths.runs='/shared/runs\n#SBATCH --uid=0'", "paths.runs"),
])
def test_strings_that_would_reach_sbatch_as_shell_lines_are_refused(override, field, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    assert main(["launch", "hourglass", "cluster=h100", "--dry-run", override]) == 2
    err = capsys.readouterr().err
    assert f"`{field}`" in err and "Fix:" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_experiment_and_variant_names_reach_sbatch_only_as_sanitised_job_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "absent-cache"))
    assert main(["launch", "hourglass", "cluster=h100", "paths.runs=/shared/runs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    names = [line.split("=", 1)[1] for line in out.splitlines() if line.startswith("#SBATCH --job-name=")]
    assert names == ["hourglass-prepare", "hourglass-tune"]


def test_scales_an_experiment_places_on_their_own_nodes_go_out_as_one_array_per_layout(tmp_path, monkeypatch,
                                                                                         capsys):
    """The release placed as its comments say, in its own `at:` (3B on four nodes, 8B on eight): each layout is an
    array of its own with its own `--nodes`; one array of every run at the first run's layout would start the 8B runs
    on one node."""
    import re

    def place(text: str) -> str:
        for scale, nodes in (("3B", 4), ("8B", 8)):
            text = re.sub(rf"^  {scale}: \{{", f"  {scale}: {{cluster.nodes: {nodes}, ", text, flags=re.M)
        return text

    out = dry_run_of_edited("hourglass_release", place, tmp_path, monkeypatch, capsys)
    arrays = [(int(re.search(r"array of (\d+) runs", part)[1]), re.findall(r"#SBATCH --nodes=(\d+)", part))
              for part in out.split("stage train:")[1:]]
    assert arrays == [(9, ["1"]), (3, ["4"]), (3, ["8"])]
    assert list(tmp_path.iterdir()) == [tmp_path / "sweeps"]


def dry_run_of_edited(experiment: str, edit, tmp_path, monkeypatch, capsys) -> str:
    """The dry run of a shipped experiment whose file `edit` (text -> text) changed, in a copy of `sweeps/`, with no
    scheduler, store or data cache to ask."""
    import shutil

    tree = tmp_path / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    path = tree / "experiment" / f"{experiment}.yaml"
    path.write_text(edit(path.read_text()))
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "absent-cache"))
    assert main(["launch", experiment, "cluster=h100", "paths.runs=/shared/runs", "--dry-run"]) == 0
    return capsys.readouterr().out
