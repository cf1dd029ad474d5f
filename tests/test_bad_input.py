"""Bad input, every command: one paragraph naming the field and the fix, exit status 2, no traceback, nothing
written or submitted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from study.cli import main

BAD_EXPERIMENTS = {
    "unknown_key": {"baseline": "a", "scales": ["tiny"], "seeds": [0], "variants": {"a": {}}, "colour": "red"},
    "bad_baseline": {"baseline": "zzz", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": {}}},
    "no_reference": {"baseline": "uniform", "scales": ["tiny"], "seeds": [0],
                     "variants": {"uniform": {}, "geometry": {"model": "geometry"}}},
    "bad_seeds": {"baseline": "conventional", "scales": ["tiny"], "seeds": [-1], "variants": {"conventional": {}}},
    "bad_preset": {"baseline": "x", "scales": ["tiny"], "seeds": [0], "variants": {"x": {"model": "nosuch"}}},
    "bad_scale": {"baseline": "conventional", "scales": ["7T"], "seeds": [0], "variants": {"conventional": {}}},
}

# (argv, the field the message must name)
CASES = [
    (["plan", "nosuch"], "EXPERIMENT"),
    (["plan", "demo", "model=nosuch"], "model"),
    (["plan", "demo", "scale=3B"], "scale"),
    (["plan", "demo", "train.nosuch=1"], "train.nosuch"),
    (["plan", "demo", "train.lr=abc"], "train.lr"),
    (["plan", "demo", "justtext"], "justtext"),
    (["plan", "demo", "model.d_model=-5"], "model.d_model"),
    (["plan", "demo", "model.ffn.hidden_ratio=1.5"], "model.ffn.width"),
    (["plan", "demo", "model.n_heads=3"], "model.n_heads"),
    (["plan", "demo", "budget.match=sideways"], "budget.match"),
    (["plan", "demo", "budget.mode=some"], "budget.mode"),
    (["plan", "demo", "model.block=gpt"], "model.block"),
    (["plan", "demo", "model.ffn.schedule=zigzag"], "model.ffn.schedule"),
    (["plan", "demo", "model.ffn.k=0"], "model.ffn.k"),
    (["plan", "demo", "train.precision=fp8"], "train.precision"),
    (["plan", "demo", "data.seq_len=0"], "data.seq_len"),
    (["plan", "demo", "data.seq_len=4096"], "data.seq_len"),
    (["plan", "demo", "train.micro_batch=0"], "train.micro_batch"),
    (["plan", "demo", "cluster.time_min=1", "cluster.signal_delay_s=120"], "cluster.signal_delay_s"),
    (["plan", "unknown_key"], "unknown_key.yaml: colour"),
    (["plan", "bad_baseline"], "bad_baseline.yaml: baseline"),
    (["plan", "no_reference"], "no_reference.yaml: reference"),
    (["plan", "bad_seeds"], "bad_seeds.yaml: seeds"),
    (["plan", "bad_preset"], "model"),
    (["plan", "bad_scale"], "scale"),
    (["plan", "broken_yaml"], "broken_yaml.yaml"),
    (["plan", "demo", "cluster=badprofile"], "cluster.reservation"),
    (["launch", "demo", "cluster=nosuch"], "cluster"),
    (["launch", "demo", "cluster=slurm"], "cluster"),  # with SLURM_CONF pointing nowhere
    (["train", "experiment=demo", "variant=nosuch"], "variant/scale/seed"),
    (["train", "scale=tiny", "train.lr_schedule=linear"], "train.lr_schedule"),
    (["train", "scale=tiny", "data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer"),
    (["eval", "nosuchkey"], "RUN_KEY"),
    (["eval", "nosuchkey", "shots=5"], "shots"),
    (["profile", "nosuchkey"], "RUN_KEY"),
    (["allocate", "--profile", "/no/profile.json", "--budget-from", "demo:tiny"], "profile"),
    (["allocate", "--profile", "/no/profile.json", "--budget-from", "demo"], "--budget-from"),
    (["allocate", "--profile", "/no/profile.json", "--budget-from", "demo:113M"], "--budget-from"),
    (["report", "demo", "--tracking-uri", "sqlite:////no/such/dir/mlflow.db"], "tracking_uri"),
]


@pytest.fixture
def bad_tree(tmp_path, monkeypatch, data_cache):
    import shutil

    tree = tmp_path / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    for name, spec in BAD_EXPERIMENTS.items():
        (tree / "experiment" / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    (tree / "experiment" / "broken_yaml.yaml").write_text("baseline: [unclosed\n")
    (tree / "cluster" / "badprofile.yaml").write_text("# @package _global_\ncluster: {reservation: x}\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return work


@pytest.mark.parametrize("argv,field", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_refused_naming_the_field(argv, field, bad_tree, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{field}`" in err and "Fix:" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1  # one paragraph
    assert sorted(p.name for p in bad_tree.iterdir()) == []  # nothing written: no store, no runs, no reports


def test_bad_input_count_covers_every_command():
    assert len(CASES) >= 25
    assert {c[0][0] for c in CASES} >= {"plan", "launch", "train", "eval", "profile", "allocate", "report"}


def test_the_real_command_exits_2_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "study.cli", "plan", "demo", "scale=3B"], capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "STUDY_SWEEPS": str(ROOT / "sweeps")})
    assert out.returncode == 2 and "`scale`" in out.stderr and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []
