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
from study.errors import StudyError

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


@pytest.mark.no_store
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


@pytest.mark.no_store
@pytest.mark.parametrize("linked", ["_launch", "_launch/manifest.jsonl", "_launch/jobs.jsonl"])
def test_a_linked_launch_folder_or_journal_is_refused_and_nothing_is_written_through_it(linked, workdir, capsys):
    from study.launch.manifest import write_manifest
    from study.launch.scheduler import record

    experiment = workdir / "runs" / "demo"
    outside = workdir / "outside"
    outside.mkdir()
    (experiment / "_launch").mkdir(parents=True, exist_ok=linked == "_launch")
    if linked == "_launch":
        (experiment / "_launch").rmdir()
    (experiment / linked).symlink_to(outside if linked == "_launch" else outside / "victim.jsonl")
    err = refused(["launch", "demo"], capsys)
    assert f"error in `{experiment / linked}`: is a symbolic link" in err
    writers = {"manifest": lambda: write_manifest(workdir / "runs", "demo", [], ["0123456789ab"]),
               "jobs": lambda: record(workdir / "runs", "demo", [{"key": "0123456789ab", "job_id": "1"}])}
    for name, write in writers.items():
        if linked == "_launch" or name in linked:
            with pytest.raises(StudyError, match="is a symbolic link"):
                write()
    assert list(outside.iterdir()) == []
    assert sorted(str(p.relative_to(experiment)) for p in experiment.rglob("*")) == sorted(
        {"_launch", linked})  # no run spec, manifest line or journal entry anywhere
    assert not (workdir / "mlflow.db").exists()


def _handed_spec(workdir, **changes):
    """A spec `study train` planned and wrote, then edited by hand (`changes` to its JSON, `config.<field>` for the
    config's): the file `study train --spec` is given."""
    path = write_spec(select_run(RUN))
    raw = json.loads(path.read_text())
    for field, value in changes.items():
        *parents, leaf = field.split(".")
        node = raw
        for name in parents:
            node = node[name]
        node[leaf] = value
    handed = workdir / "handed.json"
    handed.write_text(json.dumps(raw))
    return handed, raw


@pytest.mark.parametrize("change,field", [
    ({"dir": "{outside}/run"}, "dir"),
    ({"dir": "{runs}/other/{key}"}, "dir"),
    ({"config.experiment": "../../outside", "dir": "{runs}/../../outside/{key}"}, "experiment"),
    ({"key": "../../outside", "dir": "{runs}/sec/../../outside"}, "key"),
    ({"config.paths.runs": "{outside}"}, "dir"),
], ids=["dir outside", "dir of another experiment", "experiment a path", "key a path", "paths.runs elsewhere"])
def test_train_spec_must_name_its_own_run_directory_under_paths_runs(change, field, workdir, capsys):
    outside = workdir / "outside"
    outside.mkdir()
    runs, key = (workdir / "runs").resolve(), select_run(RUN).key
    handed, raw = _handed_spec(workdir, **{k: v.format(outside=outside, runs=runs, key=key)
                                           for k, v in change.items()})
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
    err = refused(["train", "--spec", str(handed)], capsys)
    assert f"error in `{field}`" in err
    if field == "dir":
        assert f"is not {runs if 'config.paths.runs' not in change else outside}/sec/{key}" in err
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before and list(outside.iterdir()) == []


def test_train_spec_takes_the_spec_the_planner_wrote_from_where_it_was_planned(workdir, tmp_path, monkeypatch,
                                                                              capsys):
    path = write_spec(select_run(RUN))
    assert main(["train", "--spec", str(path), "--cfg", "job"]) == 0
    assert f"dir: {path.parent}" in capsys.readouterr().out
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # paths.runs=runs is another folder here
    err = refused(["train", "--spec", str(path), "--cfg", "job"], capsys)
    assert f"error in `dir`: the run spec's directory {path.parent} is not {elsewhere}/runs/sec/" in err
    assert list(elsewhere.iterdir()) == []


# export --force


@pytest.mark.integration
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
    # passwords by every name a shell, a tool or a config gives them
    ("export DB_PASS=p1 DB_PWD=p2 GITHUB_PAT=p3 SSHPASS=p4", "export DB_PASS=*** DB_PWD=*** GITHUB_PAT=*** SSHPASS=***"),
    ("curl -u alice:pw1 https://x && curl --user=bob:pw2 https://y", "curl -u alice:*** https://x && curl --user=bob:*** https://y"),
    ("sshpass -p 'pw 1' ssh host; sshpass -v -ppw2 ssh host", "sshpass -p *** ssh host; sshpass -v -p*** ssh host"),
    ("Password: pw1", "Password: ***"),
    ('{"PASSWORD": "pw\\"1", "user": "bob"}', '{"PASSWORD": "***", "user": "bob"}'),
    ("{'db_password': pw2}", "{'db_password': ***}"),
    ("http://alice:pw@127.0.0.1:5000/x", "http://alice:***@127.0.0.1:5000/x"),
    # signed URLs keep every query parameter but their signature and credentials
    ("https://acct.blob.core.windows.net/c/f?sv=2022&sig=abc%2B&se=2030", "https://acct.blob.core.windows.net/c/f?sv=2022&sig=***&se=2030"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Date=1&X-Amz-Signature=ff&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Date=1&X-Amz-Signature=***&X-Amz-Expires=60"),
    ("https://h/f?token=t1&page=2#top", "https://h/f?token=***&page=2#top"),
    ("https://h/f?page=2&access_token=t2", "https://h/f?page=2&access_token=***"),
    # not secrets: vocabulary entries, user names of other schemes, ordinary options and overrides
    ("data.eos_token=<|endoftext|>", "data.eos_token=<|endoftext|>"),
    ("postgresql://study@db/mlflow", "postgresql://study@db/mlflow"),
    ("torchrun --nproc-per-node 8 train.py model.ffn.k=8", "torchrun --nproc-per-node 8 train.py model.ffn.k=8"),
    # nor the shell's working directory, a figure per token, a run key, a path or a word that ends in `pass`
    ("cd $PWD && PWD=/home/u OLDPWD=/tmp ls", "cd $PWD && PWD=/home/u OLDPWD=/tmp ls"),
    ("flops_per_token=6.1e6 run_key=0123456789ab", "flops_per_token=6.1e6 run_key=0123456789ab"),
    ("/scratch/pass/run.json BYPASS=1 compass=2 https://h/f?page=2", "/scratch/pass/run.json BYPASS=1 compass=2 https://h/f?page=2"),
    ("curl -u alice https://x", "curl -u alice https://x"),
])
def test_each_secret_form_is_masked_and_other_text_kept(text, masked):
    assert mask_text(text) == masked


# made-up credentials of the shapes GitHub, GitLab, Hugging Face, OpenAI and Slack issue (built here, so no scanner
# takes this file for a leak)
GHP, GLPAT, HF, SK, XOXB = "ghp_" + "x" * 36, "glpat-" + "x" * 20, "hf_" + "x" * 34, "sk-proj-" + "x" * 24, "xoxb-" + "1" * 12


@pytest.mark.parametrize("text,masked", [
    # a password whose name is one word with its client's prefix, or whose last word ends in `pass`
    ("PGPASSWORD=pw1 psql -h db -U study", "PGPASSWORD=*** psql -h db -U study"),
    ("export PGPASS=p1 MYSQL_PWD=p2 REDIS_PASSWORD=p3 RSYNC_PASSWORD=p4 AWS_SESSION_TOKEN=p5 HFTOKEN=p6",
     "export PGPASS=*** MYSQL_PWD=*** REDIS_PASSWORD=*** RSYNC_PASSWORD=*** AWS_SESSION_TOKEN=*** HFTOKEN=***"),
    ('psql "postgresql://study:pw1@db/mlflow"', 'psql "postgresql://study:***@db/mlflow"'),
    # clients whose option takes a password though its name does not say so
    ("mysql -h db -u root -ppw1 mlflow && mysqldump -p'pw 2' mlflow > d.sql",
     "mysql -h db -u root -p*** mlflow && mysqldump -p*** mlflow > d.sql"),
    ("mariadb --password=pw1 mlflow", "mariadb --password=*** mlflow"),
    ("redis-cli -h db -p 6379 -a pw1 ping", "redis-cli -h db -p 6379 -a *** ping"),
    ("docker login -u me -p pw1 ghcr.io && docker run -p 8080:80 img",
     "docker login -u me -p *** ghcr.io && docker run -p 8080:80 img"),
    ("apptainer remote login -u me -p pw1 docker://ghcr.io", "apptainer remote login -u me -p *** docker://ghcr.io"),
    ('mongosh "mongodb://db" -u study -p pw1', 'mongosh "mongodb://db" -u study -p ***'),
    ('ldapsearch -x -D "cn=me,dc=site" -w pw1 uid=me', 'ldapsearch -x -D "cn=me,dc=site" -w *** uid=me'),
    # keys given as arguments
    ("wandb login k1 && wandb login --relogin --host https://wandb.site k2",
     "wandb login *** && wandb login --relogin --host https://wandb.site ***"),
    ("aws configure set aws_secret_access_key s1 && aws configure set region us-east-1",
     "aws configure set aws_secret_access_key *** && aws configure set region us-east-1"),
    ('echo "machine api.wandb.ai login me password k1" >> ~/.netrc',
     'echo "machine api.wandb.ai login me password ***" >> ~/.netrc'),
    # credentials known by their shape, wherever they stand
    ("export AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE", "export AWS_ACCESS_KEY_ID=***"),
    (f"echo {GHP} | gh auth login --with-token; git push https://x-access-token:{GHP}@github.com/o/r",
     "echo *** | gh auth login --with-token; git push https://x-access-token:***@github.com/o/r"),
    (f"echo {GLPAT} {HF} {SK} {XOXB}", "echo *** *** *** ***"),
    # an assignment quoting another, as an override's echo does, hides neither of two secrets in different forms
    ("cluster.partition='gpu DB_PASSWORD=pw1 mysql -ppw2'", "cluster.partition='gpu DB_PASSWORD=*** mysql -p***'"),
    ('x="a PGPASSWORD=pw1 --token t2" oops https://u:pw3@h', 'x="a PGPASSWORD=*** --token ***" oops https://u:***@h'),
    # not secrets: words ending in `pass`, a pass count, the pgpass file, ports, a password left to a prompt
    ("passes=3 num_passes=2 COMPASS=1 BYPASS=2 PGPASSFILE=~/.pgpass", "passes=3 num_passes=2 COMPASS=1 BYPASS=2 PGPASSFILE=~/.pgpass"),
    ("mysql -u root -p mlflow; sshpass -f pw.txt ssh -p 2222 host; docker run -p 8080:80 img",
     "mysql -u root -p mlflow; sshpass -f pw.txt ssh -p 2222 host; docker run -p 8080:80 img"),
    ("wandb login --relogin $WANDB_API_KEY", "wandb login --relogin $WANDB_API_KEY"),
    # help text's placeholders (`write key=value`): no value to hide, and the help must stay readable
    ("Fix: write key=value (also +key=value), or --token=<value>", "Fix: write key=value (also +key=value), or --token=<value>"),
    ("key=valued token=VALUES", "key=*** token=***"),
])
def test_each_client_password_form_is_masked_exactly(text, masked):
    assert mask_text(text) == masked


SETUP = ["wandb login ${oc.env:STUDY_TEST_WANDB}", "huggingface-cli login --token hf_abcdefgh",
         "export OPENAI_KEY=sk-abcdefgh", "curl -H 'Authorization: Bearer zyxwvuts' https://tok_abcdefgh@host/x",
         "export DB_PWD=pwd_abcdefgh SSHPASS=ssh_abcdefgh", "sshpass -p spw_abcdefgh ssh host",
         "curl -u alice:cu_abcdefgh -o f 'https://a.blob.core.windows.net/c/f?sv=1&sig=sig_abcdefgh&se=2'",
         """echo '{"password": "json_abcdefgh"}' > db.json""", "export WANDB_API_KEY=${oc.env:STUDY_TEST_WANDB}",
         "export PGPASSWORD=pgpw_abcdefgh", "mysql -u study -pmy_abcdefgh mlflow -e 'select 1'"]
SECRETS = ("wandb-from-env-123", "hf_abcdefgh", "sk-abcdefgh", "zyxwvuts", "tok_abcdefgh", "pwd_abcdefgh",
           "ssh_abcdefgh", "spw_abcdefgh", "cu_abcdefgh", "sig_abcdefgh", "json_abcdefgh", "pgpw_abcdefgh",
           "my_abcdefgh")
SETUP_OVERRIDE = "cluster.setup=[" + ",".join(json.dumps(line) for line in SETUP) + "]"


@pytest.mark.integration
def test_secrets_never_reach_stdout_run_directories_or_mlflow(workdir, monkeypatch, capsys):
    from mlflow import MlflowClient

    from study.train.loop import train

    monkeypatch.setenv("STUDY_TEST_WANDB", SECRETS[0])
    args = [*RUN, SETUP_OVERRIDE, "data.eos_token='<|endoftext|>'"]
    assert main(["train", *args, "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    assert not [s for s in SECRETS if s in printed]
    assert "wandb login ${oc.env:STUDY_TEST_WANDB,***}" in printed and "login --token ***" in printed
    for kept in ("DB_PWD=*** SSHPASS=***", "sshpass -p *** ssh host", "curl -u alice:*** -o f", "?sv=1&sig=***&se=2",
                 "> db.json", "export PGPASSWORD=***", "mysql -u study -p*** mlflow"):
        assert kept in printed
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
        assert not [s for s in SECRETS if s in text] and "OPENAI_KEY=***" in text and "PGPASSWORD=***" in text


def test_a_value_read_from_the_environment_is_reread_by_the_job_and_masked_without_it(workdir, monkeypatch):
    monkeypatch.setenv("STUDY_TEST_WANDB", SECRETS[0])
    spec = select_run([*RUN, SETUP_OVERRIDE])
    path = write_spec(spec)
    assert SECRETS[0] not in path.read_text()
    assigned = SETUP.index("export WANDB_API_KEY=${oc.env:STUDY_TEST_WANDB}")  # a secret by its name, too
    assert "export WANDB_API_KEY=${oc.env:STUDY_TEST_WANDB,***}" in path.read_text()
    setup = read_spec(path).config.cluster.setup  # the job's environment
    assert (setup[0], setup[assigned]) == (f"wandb login {SECRETS[0]}", f"export WANDB_API_KEY={SECRETS[0]}")
    monkeypatch.delenv("STUDY_TEST_WANDB")
    setup = read_spec(path).config.cluster.setup  # a reader without the variable
    assert (setup[0], setup[assigned]) == ("wandb login ***", "export WANDB_API_KEY=***")


@pytest.mark.integration
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


def test_an_error_message_quoting_an_override_is_masked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = refused(["train", "scale=tiny", "cluster.partition='gpu DB_PASSWORD=hunter2'"], capsys)
    assert "error in `cluster.partition`: 'gpu DB_PASSWORD=***' is not one SLURM word" in err


def test_an_override_echoed_whole_is_masked_in_every_form_it_quotes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = refused(["train", "scale=tiny", "x=\"a PGPASSWORD=hunter2 mysql -phunter3\" oops"], capsys)
    assert 'x="a PGPASSWORD=*** mysql -p***" oops`: is not an override' in err
    assert "hunter" not in err and list(tmp_path.iterdir()) == []


EXPERIMENT = "baseline: conventional\nseeds: [0]\nscales: [tiny]\nvariants: {conventional: {}}\n"


def test_plan_prints_the_description_masked_and_its_hidden_characters_as_escapes(tree, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.chdir(tmp_path)
    (tree / "experiment" / "desc.yaml").write_text(
        'description: "db PGPASSWORD=pw1 mysql -ppw2 \\u202edecoy\\u202c \\x1b[2Jend"\n' + EXPERIMENT)
    assert main(["plan", "desc"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert title == "desc: db PGPASSWORD=*** mysql -p*** \\u202edecoy\\u202c \\x1b[2Jend (baseline conventional)"
    assert [p.name for p in tmp_path.iterdir()] == ["sweeps"]  # the config tree's copy: nothing written


def test_an_error_quoting_an_experiment_file_shows_its_hidden_characters_as_escapes(tree, tmp_path, monkeypatch,
                                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    (tree / "experiment" / "bidi.yaml").write_text(EXPERIMENT + '"descr\\u202eiption": x\n')
    err = refused(["plan", "bidi"], capsys)
    assert "error in `bidi.yaml: descr\\u202eiption`: is not an experiment key" in err and "\u202e" not in err


SITE = ["export PGPASSWORD=pg_abcdefgh", "mysql -u study -pmy_abcdefgh -e 'select 1'",
        "redis-cli -h db -a rd_abcdefgh ping", "FOO='a DB_PASSWORD=db_abcdefgh'"]


def test_a_cluster_preset_setup_line_is_masked_in_the_dry_run_and_the_run_spec(tree, workdir, monkeypatch, capsys):
    (tree / "cluster" / "site.yaml").write_text(
        "# @package _global_\ncluster: {name: site, partition: gpu, setup: " + json.dumps(SITE) + "}\n")
    (tree / "experiment" / "pg.yaml").write_text(EXPERIMENT)
    monkeypatch.setenv("SLURM_CONF", str(workdir / "absent.conf"))  # a dry run never asks the scheduler
    assert main(["launch", "pg", "cluster=site", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in ("export PGPASSWORD=***", "mysql -u study -p*** -e 'select 1'", "redis-cli -h db -a *** ping",
                 "FOO='a DB_PASSWORD=***'"):
        assert f"\n{line}\n" in out
    assert "_abcdefgh" not in out and not (workdir / "runs").exists()
    spec = select_run([*TINY, "experiment=pg", "cluster=site"])
    assert spec.config.cluster.setup == SITE  # the job runs the lines as written
    written = json.loads(write_spec(spec).read_text())
    assert written["config"]["cluster"]["setup"] == ["export PGPASSWORD=***", "mysql -u study -p*** -e 'select 1'",
                                                     "redis-cli -h db -a *** ping", "FOO='a DB_PASSWORD=***'"]


def _port_nothing_listens_on() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [["status", "demo"], ["launch", "demo"], ["report", "demo"], ["train", *RUN]],
                         ids=["status", "launch", "report", "train"])
@pytest.mark.no_store
def test_a_tracking_server_that_does_not_answer_is_refused_at_first_contact_with_its_uri_masked(argv, workdir,
                                                                                                monkeypatch, capsys):
    port = _port_nothing_listens_on()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret@127.0.0.1:{port}")
    err = refused(argv, capsys)
    assert (f"error in `tracking.uri`: the MLflow server http://alice:***@127.0.0.1:{port} does not answer "
            "(connection refused). Fix: start the tracking server") in err
    assert "s3cret" not in err and list(workdir.iterdir()) == []  # no spec, manifest or store written


@pytest.mark.timeout(60)
def test_the_probe_asks_once_and_gives_up_after_its_timeout(tmp_path):
    """A server that takes the connection and never replies (a hung proxy) is refused after the probe's timeout:
    one connection, none of MLflow's retries (seven, backing off, about four minutes)."""
    import socket

    from study.track.store import check_answers

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nothing ever reads or answers
        port = silent.getsockname()[1]
        with pytest.raises(StudyError) as refusal:
            check_answers(f"https://bob:pw@127.0.0.1:{port}/mlflow", timeout_s=0.5)
        silent.setblocking(False)
        attempts = []
        while True:  # every connection the probe opened waits in the listen queue
            try:
                attempts.append(silent.accept()[0])
            except BlockingIOError:
                break
        for conn in attempts:
            conn.close()
    assert len(attempts) == 1
    assert (refusal.value.field, refusal.value.problem) == (
        "tracking.uri", f"the MLflow server https://bob:***@127.0.0.1:{port}/mlflow does not answer (no answer within 0.5 s)")
    check_answers(f"sqlite:///{tmp_path}/none.db")  # local stores are not probed: nothing to wait for
    assert list(tmp_path.iterdir()) == []


@pytest.mark.no_store
def test_a_local_launch_refuses_a_warm_server_in_a_folder_others_can_write_before_writing_anything(workdir,
                                                                                                 monkeypatch, capsys):
    """`STUDY_WARM_SERVER` naming a socket where another user could listen (each job would hand that process its
    environment): refused by the variable's name, even with no socket there yet; no spec, manifest or store."""
    public = workdir / "public"
    public.mkdir()
    public.chmod(0o1777)
    monkeypatch.setenv("STUDY_WARM_SERVER", str(public / "socket"))
    err = refused(["launch", "demo"], capsys)
    assert (f"error in `STUDY_WARM_SERVER`: {public / 'socket'}: other users can write the folder {public} "
            "(mode 1777), so the process listening there could be another user's") in err
    assert 'Fix: serve from a folder that is yours and only you can write: `python -m study.launch.warm serve ' \
           '"$(mktemp -d)"`' in err
    assert list(workdir.iterdir()) == [public] and list(public.iterdir()) == []


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
