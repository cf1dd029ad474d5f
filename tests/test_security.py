"""What an adversary's input cannot do: names and paths leave no root, nothing in a run directory is written through
a link, `export --force` removes only its own files, secrets are masked whatever form they take, and input crafted
to take minutes (an alias bomb, an absurd budget) is refused at once."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from conftest import ROOT, TINY, TRAINING_RUNS
from study.cli import main
from study.config.spec import read_spec, write_spec
from study.plan.planner import select_run
from study.config.secrets import mask_text

RUN = [*TINY, "experiment=sec", "train.max_steps=2"]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A private copy of the config tree (experiment files can be added) and an empty working directory."""
    sweeps = tmp_path / "sweeps"
    shutil.copytree(ROOT / "sweeps", sweeps)
    monkeypatch.setenv("STUDY_SWEEPS", str(sweeps))
    return sweeps


def refused(argv, capsys) -> str:
    """The one-paragraph message of a refusal (exit status 2)."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


# names and paths


@pytest.mark.parametrize("argv,field", [
    (["train", "experiment=../../escaped", "scale=tiny"], "experiment"),
    (["train", "scale=tiny", "variant=../../escaped"], "variant"),
    (["plan", "demo", "data=../../escaped/evil"], "data"),
    (["report", "../../escaped"], "EXPERIMENT"),
])
def test_a_name_that_would_leave_its_root_is_refused_and_nothing_is_written(argv, field, tree, tmp_path,
                                                                             monkeypatch, capsys):
    work = tmp_path / "a" / "b" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    (tmp_path / "escaped").mkdir()
    (tmp_path / "escaped" / "evil.yaml").write_text("train: {lr: 9.0}\n")  # what data=../../escaped/evil reaches
    assert f"error in `{field}`" in refused(argv, capsys)
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.rglob("*") if "sweeps" not in p.parts) == ["a", "b", "escaped",
                                                                                      "evil.yaml", "work"]


def test_an_experiment_file_naming_a_scale_or_group_outside_the_tree_is_refused(tree, tmp_path, monkeypatch,
                                                                                capsys):
    monkeypatch.chdir(tmp_path)
    base = "baseline: conventional\nseeds: [0]\nvariants: {conventional: {}}\n"
    (tree / "experiment" / "up_scale.yaml").write_text(base + "scales: ['../scale/tiny']\n")
    (tree / "experiment" / "up_group.yaml").write_text(base + "scales: [tiny]\ncommon: {data: ../data/docstrings}\n")
    (tree / "experiment" / "up_preset.yaml").write_text(
        "baseline: a\nseeds: [0]\nscales: [tiny]\nvariants: {a: {model: ../model/conventional}}\n")
    assert "error in `scale`: unknown option '../scale/tiny'" in refused(["plan", "up_scale"], capsys)
    assert "error in `data`: unknown option '../data/docstrings'" in refused(["plan", "up_group"], capsys)
    assert "error in `model`: unknown option '../model/conventional'" in refused(["plan", "up_preset"], capsys)


def test_a_report_out_that_is_a_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").write_text("mine")
    assert "error in `--out`: reports is a file" in refused(["report", "demo", "--out", "reports"], capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["reports"] and (tmp_path / "reports").read_text() == "mine"


# links in a run directory


@pytest.mark.parametrize("name", [".lease", "config.yaml", "result.json", "metrics.jsonl", "export"])
def test_training_refuses_a_link_in_its_run_directory_and_leaves_its_target_alone(name, workdir, capsys):
    spec = select_run(RUN)
    outside = workdir / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("not the run's")
    spec.run_dir.path.mkdir(parents=True)
    (spec.run_dir.path / name).symlink_to(outside if name == "export" else outside / "victim.txt")
    err = refused(["train", *RUN], capsys)
    assert f"error in `{spec.run_dir.path / name}`: is a symbolic link" in err
    assert [p.name for p in outside.iterdir()] == ["victim.txt"] and (outside / "victim.txt").read_text() == "not the run's"
    assert sorted(p.name for p in spec.run_dir.path.iterdir()) == [name]  # no spec, checkpoint or lease written
    assert not (workdir / "mlflow.db").exists()


def test_export_refuses_a_linked_export_folder(workdir, capsys):
    spec = select_run(RUN)
    write_spec(spec)
    outside = workdir / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("not the run's")
    spec.run_dir.path.joinpath("export").symlink_to(outside)
    err = refused(["export", spec.key, "--format", "hf", "--force"], capsys)
    assert f"error in `{spec.run_dir.path / 'export'}`: is a symbolic link" in err
    assert [p.name for p in outside.iterdir()] == ["config.json"]
    assert (outside / "config.json").read_text() == "not the run's"


# export --force


def test_export_force_replaces_only_the_files_its_manifest_lists(workdir, capsys):
    from study.train.loop import train

    spec = select_run(RUN)
    assert train(spec).status == "FINISHED"
    export = ["export", spec.key, "--format", "hf"]
    assert main(export) == 0
    out = spec.run_dir.export
    manifest = json.loads((out / "study_export.json").read_text())
    written = sorted(p.name for p in out.iterdir())
    assert manifest["files"] == written and {"config.json", "model.safetensors", "study_export.json"} <= set(written)
    (out / "notes.md").write_text("the user's own")
    (out / "old_shard.safetensors").write_text("an earlier export's")  # listed by the earlier manifest below
    manifest["files"].append("old_shard.safetensors")
    (out / "study_export.json").write_text(json.dumps(manifest))
    assert main([*export, "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*written, "notes.md"])
    assert (out / "notes.md").read_text() == "the user's own"

    (workdir / "victim.txt").write_text("outside the export")
    manifest["files"] = ["../../../../victim.txt"]
    (out / "study_export.json").write_text(json.dumps(manifest))
    assert "error in `--out`" in refused([*export, "--force"], capsys)
    assert (workdir / "victim.txt").read_text() == "outside the export"


# secrets


@pytest.mark.parametrize("text,masked", [
    ("huggingface-cli login --token hf_abcdef", "huggingface-cli login --token ***"),
    ("huggingface-cli login --token=hf_abcdef", "huggingface-cli login --token=***"),
    ("export WANDB_KEY=abc123", "export WANDB_KEY=***"),
    ("OPENAI_KEY='sk-a b' python x.py", "OPENAI_KEY=*** python x.py"),
    ("export SERVICE_TOKEN=t1 DB_PASSWORD=p2 AWS_SECRET_ACCESS_KEY=s3",
     "export SERVICE_TOKEN=*** DB_PASSWORD=*** AWS_SECRET_ACCESS_KEY=***"),
    ('curl -H "Authorization: Bearer abc.def" https://api', 'curl -H "Authorization: ***" https://api'),
    ("curl -H 'Authorization: Basic dXNlcjpwdw==' x", "curl -H 'Authorization: ***' x"),
    ("Bearer abc.def", "Bearer ***"),
    ("curl -H 'X-Api-Key: k123' -H 'PRIVATE-TOKEN: glpat-x' x", "curl -H 'X-Api-Key: ***' -H 'PRIVATE-TOKEN: ***' x"),
    ("git clone https://ghp_abc@github.com/o/r", "git clone https://***@github.com/o/r"),
    ("pip install --index-url https://user:pw@pypi.example/simple x",
     "pip install --index-url https://user:***@pypi.example/simple x"),
    # not secrets: vocabulary entries, user names of other schemes, ordinary options and overrides
    ("data.eos_token=<|endoftext|>", "data.eos_token=<|endoftext|>"),
    ("postgresql://study@db/mlflow", "postgresql://study@db/mlflow"),
    ("torchrun --nproc-per-node 8 train.py model.ffn.k=8", "torchrun --nproc-per-node 8 train.py model.ffn.k=8"),
])
def test_each_secret_form_is_masked_and_other_text_kept(text, masked):
    assert mask_text(text) == masked


SETUP = ["wandb login ${oc.env:STUDY_TEST_WANDB}", "huggingface-cli login --token hf_abcdefgh",
         "export OPENAI_KEY=sk-abcdefgh", "curl -H 'Authorization: Bearer zyxwvuts' https://tok_abcdefgh@host/x"]
SECRETS = ("wandb-from-env-123", "hf_abcdefgh", "sk-abcdefgh", "zyxwvuts", "tok_abcdefgh")
SETUP_OVERRIDE = "cluster.setup=[" + ",".join(json.dumps(line) for line in SETUP) + "]"


def test_secrets_never_reach_stdout_run_directories_or_mlflow(workdir, monkeypatch, capsys):
    from mlflow import MlflowClient

    from study.train.loop import train

    monkeypatch.setenv("STUDY_TEST_WANDB", SECRETS[0])
    args = [*RUN, SETUP_OVERRIDE, "data.eos_token='<|endoftext|>'"]
    assert main(["train", *args, "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    assert not [s for s in SECRETS if s in printed]
    assert "wandb login ${oc.env:STUDY_TEST_WANDB,***}" in printed and "login --token ***" in printed
    spec = select_run(args)
    assert train(spec).status == "FINISHED"
    for path in spec.run_dir.path.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".yaml", ".jsonl"):
            assert not [s for s in SECRETS if s in path.read_text()], path
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("sec").experiment_id], filter_string=TRAINING_RUNS)
    assert not [s for s in SECRETS if s in json.dumps(run.data.params)]
    assert run.data.params["data.eos_token"] == "<|endoftext|>"
    for name in ("config.yaml", "run.json"):
        text = open(client.download_artifacts(run.info.run_id, name, str(workdir))).read()
        assert not [s for s in SECRETS if s in text] and "OPENAI_KEY=***" in text


def test_a_value_read_from_the_environment_is_reread_by_the_job_and_masked_without_it(workdir, monkeypatch):
    monkeypatch.setenv("STUDY_TEST_WANDB", SECRETS[0])
    spec = select_run([*RUN, SETUP_OVERRIDE])
    path = write_spec(spec)
    assert SECRETS[0] not in path.read_text()
    assert read_spec(path).config.cluster.setup[0] == f"wandb login {SECRETS[0]}"  # the job's environment
    monkeypatch.delenv("STUDY_TEST_WANDB")
    assert read_spec(path).config.cluster.setup[0] == "wandb login ***"  # a reader without the variable


def test_launch_manifests_and_tags_hold_the_masked_overrides(workdir):
    from study.launch.manifest import latest_manifest, write_manifest
    from study.track.query import open_store, read_manifest_tags

    uri = f"sqlite:///{workdir}/mlflow.db"
    overrides = ["cluster.setup=['huggingface-cli login --token hf_abcdefgh']", "data.eos_token=<|endoftext|>"]
    write_manifest(workdir / "runs", "sec", overrides, ["0123456789ab"], uri)
    want = ["cluster.setup=['huggingface-cli login --token ***']", "data.eos_token=<|endoftext|>"]
    assert "hf_abcdefgh" not in (workdir / "runs" / "sec" / "_launch" / "manifest.jsonl").read_text()
    assert latest_manifest(workdir / "runs", "sec", uri)["overrides"] == want
    assert read_manifest_tags(open_store(uri), "sec")["overrides"] == want


# bounded work

BOMB = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("body", ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB, "a: &a [*a]\n"],
                         ids=["alias bomb", "alias inside itself"])
def test_an_experiment_file_expanding_without_bound_is_refused_at_once(body, tree, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tree / "experiment" / "bomb.yaml").write_text(body)
    start = time.perf_counter()
    err = refused(["plan", "bomb"], capsys)
    assert time.perf_counter() - start < 10
    assert "bomb.yaml`: expands to more than 100,000 values through its YAML aliases" in err


def test_a_budget_no_depth_can_meet_is_refused_at_once_naming_budget_target(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    err = refused(["train", "scale=tiny", "budget.match=depth", "budget.target=100000000000000", "--cfg", "job"],
                  capsys)
    assert time.perf_counter() - start < 10
    assert "error in `budget.target`: meeting the budget 100,000,000,000,000 by depth takes" in err
    assert list(tmp_path.iterdir()) == []
