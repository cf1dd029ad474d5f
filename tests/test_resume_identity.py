"""A resumed run is the run it claims to be: the data it started on, checkpoints that load, a result of record that
stays where it finished, and settings placed out of the key that never stop a resume. What cannot be continued is
refused by name (exit 2), and `--restart` trains it again from step 0 with its earlier training set aside: its files
under `replaced/`, its MLflow run deleted (restorable) and tagged, and a fresh MLflow run holding the new curve
alone."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from conftest import TINY, TRAINING_RUNS, new_store
from slurm_helpers import private_sweeps
from study.cli import main
from study.plan.planner import select_run
from study.train.loop import train

pytestmark = pytest.mark.faults

RUN = [*TINY, "experiment=ident", "train.max_steps=8", "train.ckpt_interval=4", "train.val_interval=4"]


def store(workdir, db="mlflow.db"):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / db}")
    return client, client.get_experiment_by_name("ident").experiment_id


def runs(workdir, deleted: bool = False, db="mlflow.db"):
    from mlflow.entities import ViewType

    client, exp = store(workdir, db)
    view = ViewType.DELETED_ONLY if deleted else ViewType.ACTIVE_ONLY
    return client.search_runs([exp], filter_string=TRAINING_RUNS, run_view_type=view)


def curve(workdir, run, key="train/loss", db="mlflow.db") -> list[tuple[int, float]]:
    client, _ = store(workdir, db)
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def write_corpus(folder, words: str, seed: int) -> None:
    """400 documents of 60 words drawn from `words`: a local JSON-lines corpus."""
    folder.mkdir(exist_ok=True)
    rng, vocabulary = random.Random(seed), words.split()
    lines = (json.dumps({"text": " ".join(rng.choice(vocabulary) for _ in range(60))}) for _ in range(400))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.integration
def test_a_resume_on_changed_data_is_refused_and_restart_trains_on_the_new_data(workdir, capsys):
    corpus = workdir / "corpus"
    write_corpus(corpus, "the quick brown fox jumps over a lazy dog while wise owls watch from an old oak", 0)
    over = [*RUN, f"data.name={corpus}", "data.vocab_size=300"]
    spec = select_run(over)
    assert main(["train", *over, "faults.stop_at_step=4"]) == 75
    first_tokenizer = spec.run_dir.tokenizer.read_bytes()
    (old,) = runs(workdir)

    write_corpus(corpus, "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau", 1)
    capsys.readouterr()
    assert main(["train", *over]) == 2  # the same key: the corpus is named by its path
    err = capsys.readouterr().err
    assert "error in `data.name`" in err and f"run {spec.key} started on other data" in err and "--restart" in err
    assert spec.run_dir.tokenizer.read_bytes() == first_tokenizer  # never replaced under the checkpoints
    assert [p.name for p in spec.run_dir.checkpoints.iterdir()] == ["step_00000004"]
    (still,) = runs(workdir)
    assert still.info.status == "KILLED" and [s for s, _ in curve(workdir, still)] == [1, 2, 3, 4]
    assert len(still.inputs.dataset_inputs) == 1

    assert main(["train", *over, "--restart"]) == 0
    (gone,) = runs(workdir, deleted=True)
    assert gone.info.run_id == old.info.run_id and "--restart" in gone.data.tags["study.replaced"]
    (new,) = runs(workdir)
    assert new.info.status == "FINISHED" and [s for s, _ in curve(workdir, new)] == list(range(1, 9))
    assert new.inputs.dataset_inputs[0].dataset.digest != gone.inputs.dataset_inputs[0].dataset.digest
    (aside,) = (spec.run_dir.path / "replaced").iterdir()
    assert (aside / "tokenizer.json").read_bytes() == first_tokenizer
    assert [p.name for p in (aside / "checkpoints").iterdir()] == ["step_00000004"]
    assert spec.run_dir.tokenizer.read_bytes() != first_tokenizer  # the tokenizer of the data it now trained on


@pytest.mark.integration
def test_a_run_whose_every_checkpoint_is_damaged_is_refused_and_restart_replaces_its_curve(workdir, capsys):
    over = [*RUN, "train.max_steps=12"]
    clean = train(select_run([*over, "paths.runs=clean", f"tracking.uri={new_store(workdir / 'c.db')}"]))
    spec = select_run(over)
    assert train(select_run([*over, "faults.stop_at_step=8"])).status == "PREEMPTED"
    for shard in spec.run_dir.checkpoints.glob("step_*/*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # both checkpoints, 4 and 8, truncated
    capsys.readouterr()
    assert main(["train", *over]) == 2
    err = capsys.readouterr().err
    assert f"error in `{spec.run_dir.checkpoints}`: no checkpoint of run {spec.key} loads" in err
    assert "step_00000008" in err and "step_00000004" in err and "--restart" in err
    (old,) = runs(workdir)  # untouched: not reopened, no point recomputed
    assert old.info.status == "KILLED" and old.data.tags["study.restarts"] == "0"
    assert [s for s, _ in curve(workdir, old)] == list(range(1, 9))

    capsys.readouterr()
    assert main(["train", *over, "--restart"]) == 0
    assert f"run {spec.key} starts again from step 0" in capsys.readouterr().err
    (gone,) = runs(workdir, deleted=True)
    assert gone.info.run_id == old.info.run_id and gone.info.status == "KILLED"
    (new,) = runs(workdir)
    reference = runs(workdir, db="c.db")[0]
    assert new.info.status == "FINISHED" and new.info.run_id != old.info.run_id
    # the curve is the retrained one, every step once, equal to an uninterrupted run's
    assert curve(workdir, new) == curve(workdir, reference, db="c.db") and len(curve(workdir, new)) == 12
    assert curve(workdir, new, "val/loss") == curve(workdir, reference, "val/loss", db="c.db")
    assert json.loads(spec.run_dir.result.read_text())["val_loss"] == clean.val_loss
    (aside,) = (spec.run_dir.path / "replaced").iterdir()
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
    assert len((aside / "metrics.jsonl").read_text().splitlines()) > 0


@pytest.mark.integration
def test_a_restart_interrupted_midway_is_finished_by_the_next_start(workdir):
    spec = select_run(RUN)
    assert train(select_run([*RUN, "faults.stop_at_step=4"])).status == "PREEMPTED"
    (old,) = runs(workdir)
    partial = spec.run_dir.path / "replaced" / "2026-01-01T000000Z-1.partial"
    partial.mkdir(parents=True)
    shutil.move(spec.run_dir.checkpoints, partial / "checkpoints")  # killed after moving the checkpoints, not the log
    out = train(spec)
    assert out.status == "FINISHED" and min(out.losses) == 1
    assert [p.name for p in (spec.run_dir.path / "replaced").iterdir()] == ["2026-01-01T000000Z-1"]
    aside = {p.name for p in (spec.run_dir.path / "replaced" / "2026-01-01T000000Z-1").iterdir()}
    assert {"checkpoints", "metrics.jsonl", "data.json", "tokenizer.json"} <= aside and "run.json" not in aside
    (gone,) = runs(workdir, deleted=True)
    (new,) = runs(workdir)
    assert gone.info.run_id == old.info.run_id and new.info.status == "FINISHED"
    assert [s for s, _ in curve(workdir, new)] == list(range(1, 9))  # no point of the old curve taken for a repeat


@pytest.mark.integration
def test_a_finished_key_trained_under_another_runs_folder_is_refused_naming_where_it_finished(workdir, capsys):
    spec = select_run(RUN)
    assert train(spec).status == "FINISHED"
    capsys.readouterr()
    assert main(["train", *RUN, "paths.runs=elsewhere"]) == 2
    err = capsys.readouterr().err
    assert "error in `paths.runs`" in err and f"run {spec.key} has FINISHED in {spec.run_dir.path}" in err
    assert f"paths.runs={workdir / 'runs'}" in err
    (run,) = runs(workdir)  # the result of record as it was
    assert run.info.status == "FINISHED" and run.data.tags["study.restarts"] == "0"
    assert [s for s, _ in curve(workdir, run)] == list(range(1, 9))
    assert not (workdir / "elsewhere" / "ident" / spec.key / "checkpoints").exists()


@pytest.mark.integration
def test_settings_out_of_the_key_resume_the_same_run(workdir):
    assert train(select_run([*RUN, "faults.stop_at_step=4"])).status == "PREEMPTED"
    out = train(select_run([*RUN, "train.assumed_mfu=0.3", "train.ckpt_interval=2", "train.val_interval=3"]))
    assert out.status == "FINISHED" and min(out.losses) == 5
    (run,) = runs(workdir)
    assert run.data.tags["study.restarts"] == "1" and [s for s, _ in curve(workdir, run)] == list(range(1, 9))
    params = run.data.params
    assert params["train.lr"] and params["model.d_model"] == "64"
    assert not {"train.assumed_mfu", "train.ckpt_interval", "train.val_interval", "variant"} & set(params)


@pytest.mark.integration
def test_launch_restart_trains_a_finished_run_again_from_step_0(workdir, monkeypatch, capsys):
    tree = private_sweeps(workdir, "ident", variants={"conventional": {"model": "conventional"}})
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    over = ["cluster=local", "train.max_steps=4"]
    assert main(["launch", "ident", *over]) == 0
    (old,) = runs(workdir)
    key = old.data.tags["study.run_key"]
    capsys.readouterr()
    assert main(["launch", "ident", *over, "--restart", "000000000000"]) == 2
    assert "error in `--restart`: 000000000000 is no run of ident" in capsys.readouterr().err
    assert main(["launch", "ident", *over, "--dry-run", "--restart", key]) == 2
    assert "error in `--restart`" in capsys.readouterr().err
    assert runs(workdir)[0].info.run_id == old.info.run_id  # refused: nothing set aside
    assert main(["launch", "ident", *over, "--restart", key]) == 0
    (gone,) = runs(workdir, deleted=True)
    (new,) = runs(workdir)
    assert gone.info.run_id == old.info.run_id and new.info.status == "FINISHED"
    assert new.data.tags["study.run_key"] == key and [s for s, _ in curve(workdir, new)] == [1, 2, 3, 4]
    assert len(list((workdir / "runs" / "ident" / key / "replaced").iterdir())) == 1
