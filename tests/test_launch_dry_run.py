"""`study launch --dry-run`: the arrays, dependencies and sbatch scripts, pinned by golden files; nothing written."""

from __future__ import annotations

import pytest

from conftest import ROOT
from study.cli import main

GOLDEN = ROOT / "tests" / "golden"


@pytest.mark.parametrize("experiment", ["hourglass", "geometry"])
def test_dry_run_prints_the_golden_arrays_and_sbatch_scripts(experiment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))  # a dry run never asks the scheduler
    assert main(["launch", experiment, "cluster=h100", "paths.runs=/shared/runs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out == (GOLDEN / f"launch_{experiment}_h100.txt").read_text()
    assert list(tmp_path.iterdir()) == []


def test_geometry_profiles_wait_for_reference_runs_and_use_one_gpu():
    text = (GOLDEN / "launch_geometry_h100.txt").read_text()
    profile = text.split("stage profile:")[1].split("stage scheduled:")[0]
    assert "#SBATCH --gpus-per-node=1" in profile and "#SBATCH --ntasks-per-node=1" in profile
    assert "afterok:<its reference runs in the train array>" in profile
    assert "#SBATCH --signal=USR2@300" in text and "#SBATCH --requeue" in text


def test_config_strings_reach_sbatch_only_as_sanitised_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent.conf"))
    assert main(["launch", "hourglass", "cluster=h100", "paths.runs=/shared/runs", "--dry-run",
                 "cluster.partition='gpu; rm -rf /'"]) == 0
    out = capsys.readouterr().out
    assert "rm -rf" not in out.replace("#SBATCH --partition='gpu; rm -rf /'", "")
