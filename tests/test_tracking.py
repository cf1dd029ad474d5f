"""Tracking against real MLflow stores: an embedded SQLite store, and a real `mlflow server` on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from study.errors import StudyError
from conftest import new_store
from mlflow_server import start_server
from study.track.tracker import NullTracker, Tracker, TrackingConfig, flatten, resolve_tracking_uri

TAGS = {"study.experiment": "e", "study.variant": "hourglass", "study.scale": "tiny", "study.seed": "0",
        "study.role": "train", "study.baseline": "conventional"}  # fmt: skip
PARAMS = {"model": {"d_model": 64, "widths": [96, 64]}, "train": {"lr": 1e-3, "compile": False}}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return new_store(tmp_path_factory.mktemp("store") / "mlflow.db")


@pytest.fixture(scope="module")
def client(store):
    from mlflow import MlflowClient

    return MlflowClient(store)


def cfg_for(uri: str) -> TrackingConfig:
    return TrackingConfig(uri=uri, flush_interval_s=0.05, retry_initial_s=0.2, retry_max_s=1.0, open_timeout_s=60)


def steps_logged(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def runs_with_key(client, experiment: str, key: str) -> list:
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    return client.search_runs([experiment_id], filter_string=f"tags.`study.run_key` = '{key}'")


def test_tracking_uri_defaults_to_sqlite_in_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"


def test_flatten_dots_keys_and_drops_secrets_and_environment():
    config = {
        "data": {"tokenizer": "bpe-4096", "max_tokens": 10**6, "hf_token": "hf_abc", "HF_TOKEN": "hf_abc"},
        "train": {"token_budget": 5, "lr": 0.001, "compile": True, "resume": None},
        "cluster": {"apiKey": "k", "api_key": "k", "db_password": "p", "client_secret": "s",
                    "credentials": {"user": "u", "pass": "p"}, "env_set": {"WANDB_KEY": "x"}, "partition": "gpu"},
        "eval": {"tasks": [{"name": "piqa", "shots": 0}], "widths": [96, 64]},
    }  # fmt: skip
    assert flatten(config) == {
        "data.tokenizer": "bpe-4096",
        "data.max_tokens": "1000000",
        "train.token_budget": "5",
        "train.lr": "0.001",
        "train.compile": "true",
        "train.resume": "null",
        "cluster.partition": "gpu",
        "eval.tasks.0.name": "piqa",
        "eval.tasks.0.shots": "0",
        "eval.widths": "[96, 64]",
    }


def test_open_log_close_gives_one_finished_run_with_tags_params_metrics_and_artifacts(store, client):
    import threading

    tracker = Tracker.open("key-a", "schema", "hourglass-tiny-s0", TAGS, {**PARAMS, "hf_token": "hf_x"},
                           cfg=cfg_for(store))  # fmt: skip
    # the training step's thread never waits on the store: every batch of points leaves from the tracker's own
    # thread (asked of the calls themselves, not of a clock a loaded machine stretches)
    senders, log_batch = [], tracker._client.log_batch
    tracker._client.log_batch = lambda *a, **k: senders.append(threading.current_thread()) or log_batch(*a, **k)
    for step in range(200):
        tracker.log_metrics({"train/loss": 4.0 - step / 100, "train/lr": 1e-3, "train/grad_norm": 0.5}, step)
    tracker.log_metrics({"val/loss": 2.5, "val/ppl": 12.18}, 199)
    tracker.log_dict({"model": {"d_model": 64}}, "config.yaml")
    tracker.log_artifact("| group | params |\n", "tables/parameters.md")
    assert tracker.close() == 0
    assert senders and threading.main_thread() not in senders

    (run,) = runs_with_key(client, "schema", "key-a")
    assert run.info.run_id == tracker.run_id
    assert (run.info.status, run.info.run_name) == ("FINISHED", "hourglass-tiny-s0")
    assert run.data.tags.items() >= {**TAGS, "study.run_key": "key-a", "study.restarts": "0"}.items()
    assert run.data.params == {"model.d_model": "64", "model.widths": "[96, 64]", "train.lr": "0.001",
                               "train.compile": "false"}  # fmt: skip
    assert steps_logged(client, run.info.run_id, "train/loss") == list(range(200))
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val/ppl")] == [12.18]
    artifacts = Path(store.removeprefix("sqlite:///")).parent / "mlartifacts" / "schema" / run.info.run_id / "artifacts"
    assert (artifacts / "config.yaml").read_text() == "model:\n  d_model: 64\n"
    assert (artifacts / "tables" / "parameters.md").read_text() == "| group | params |\n"


def test_a_run_shorter_than_one_system_metrics_interval_still_records_its_system_metrics(store, client):
    """MLflow's monitor publishes only after a whole interval and drops what it sampled when stopped sooner: a run of
    a few seconds at the default 30 s interval would hold no `system/...` metric at all."""
    from dataclasses import replace

    tracker = Tracker.open("key-sys", "sysmetrics", "hourglass-tiny-s0", TAGS, PARAMS,
                           cfg=replace(cfg_for(store), system_metrics_s=30.0), system_metrics=True)
    tracker.log_metrics({"train/loss": 1.0}, 0)
    assert tracker.close() == 0
    metrics = client.get_run(tracker.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics


def test_reopening_a_run_key_resumes_the_same_run_and_skips_steps_already_logged(store, client):
    first = Tracker.open("key-b", "resume", "conventional-tiny-s1", TAGS, PARAMS, cfg=cfg_for(store))
    for step in range(10):
        first.log_metrics({"train/loss": 10.0 - step}, step)
        if step == 5:
            first.log_metrics({"val/loss": 7.0}, step)
    first.close("FAILED", reason="killed by the scheduler")
    run = client.get_run(first.run_id)
    assert (run.info.status, run.data.tags["study.failure_reason"]) == ("FAILED", "killed by the scheduler")

    # Resumed from a checkpoint at step 4: steps 5-9 are recomputed identically and must not land twice.
    second = Tracker.open("key-b", "resume", "conventional-tiny-s1", TAGS, PARAMS, cfg=cfg_for(store))
    assert second.run_id == first.run_id
    run = client.get_run(second.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags["study.restarts"] == "1"
    assert "study.failure_reason" not in run.data.tags
    for step in range(5, 15):
        second.log_metrics({"train/loss": 10.0 - step}, step)
        if step in (5, 10):
            second.log_metrics({"val/loss": 7.0 if step == 5 else 6.0}, step)
    assert second.close() == 0

    (run,) = runs_with_key(client, "resume", "key-b")
    assert run.info.status == "FINISHED"
    assert steps_logged(client, run.info.run_id, "train/loss") == list(range(15))
    assert steps_logged(client, run.info.run_id, "val/loss") == [5, 10]

    with pytest.raises(ValueError, match="train.lr: logged '0.001', now '0.002'"):
        Tracker.open("key-b", "resume", "conventional-tiny-s1", TAGS, {**PARAMS, "train": {"lr": 2e-3}},
                     cfg=cfg_for(store))  # fmt: skip
    (run,) = runs_with_key(client, "resume", "key-b")
    assert (run.info.status, run.data.tags["study.restarts"]) == ("FINISHED", "1")


def test_other_ranks_get_a_tracker_that_logs_nothing(store, client, tmp_path):
    from study.plan.planner import plan_adhoc
    from study.train.distributed import Dist
    from study.train.tracking import open_tracker

    spec = plan_adhoc(["experiment=ranks", f"tracking.uri={store}", f"paths.runs={tmp_path}"])
    tracker = open_tracker(spec, Dist(rank=1, world_size=2, local_rank=1, device="cpu"), data=None, start=0)
    assert isinstance(tracker, NullTracker)
    tracker.log_metrics({"train/loss": 1.0}, 0)
    tracker.record("lineage", lambda client, run_id: 1 / 0)  # never called
    assert tracker.flush() is True and tracker.close() == 0
    assert client.get_experiment_by_name("ranks") is None
    assert not spec.run_dir.config.exists()  # only rank 0 writes the run directory's config


def test_a_locked_sqlite_store_delays_points_without_blocking_logging(store, client):
    tracker = Tracker.open("key-d", "locked", "hourglass-tiny-s2", TAGS, PARAMS, cfg=cfg_for(store))
    lock = sqlite3.connect(store.removeprefix("sqlite:///"), isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    # every point is logged while the store stays locked (a log_metrics that waited on the store would never return
    # here) and is still waiting to be sent
    for step in range(100):
        tracker.log_metrics({"train/loss": float(step)}, step)
        time.sleep(0.01)
    assert tracker.pending() > 0
    lock.execute("COMMIT")
    lock.close()
    assert tracker.close(timeout_s=30) == 0
    assert steps_logged(client, tracker.run_id, "train/loss") == list(range(100))


WRITER = """
import sys, time
from study.track.tracker import Tracker, TrackingConfig
index, uri = int(sys.argv[1]), sys.argv[2]
cfg = TrackingConfig(uri=uri, flush_interval_s=0.02, retry_initial_s=0.1, retry_max_s=1.0)
tracker = Tracker.open(f"key-{index}", "concurrent", f"v{index}-tiny-s0", {"study.seed": "0"}, {"seed": index},
                       cfg=cfg)
for step in range(100):
    tracker.log_metrics({"train/loss": index + step / 100}, step)
    time.sleep(0.005)
sys.exit(tracker.close(timeout_s=60))
"""


@pytest.mark.integration
def test_processes_writing_one_fresh_sqlite_store_at_once_lose_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    writers = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(i), uri], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for i in range(4)
    ]
    for writer in writers:
        output, _ = writer.communicate(timeout=120)
        assert writer.returncode == 0, output
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    for i in range(4):
        (run,) = runs_with_key(client, "concurrent", f"key-{i}")
        assert (run.info.status, run.data.params) == ("FINISHED", {"seed": str(i)})
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted((m.step, m.value) for m in history) == [(s, i + s / 100) for s in range(100)]


def test_starting_a_server_on_a_taken_port_fails_naming_the_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StudyError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_server(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "mlartifacts", port=port)


@pytest.mark.integration
@pytest.mark.mlflow_server
def test_a_server_outage_loses_no_point_and_never_blocks_logging(tmp_path, monkeypatch):
    # One try per HTTP call, so the Tracker's own backoff (not MLflow's minutes-long internal retry) is exercised.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with start_server(new_store(tmp_path / "mlflow.db"), tmp_path / "mlartifacts") as server:
        cfg = TrackingConfig(uri=server.uri, flush_interval_s=0.2, retry_initial_s=0.5, retry_max_s=2.0)
        tracker = Tracker.open("key-s", "outage", "hourglass-tiny-s0", TAGS, PARAMS, cfg=cfg)
        stop, steps = threading.Event(), []

        def train():
            while not stop.is_set():
                tracker.log_metrics({"train/loss": 1.0 / (len(steps) + 1)}, len(steps))
                steps.append(len(steps))
                time.sleep(0.01)

        trainer = threading.Thread(target=train)
        trainer.start()
        time.sleep(1.0)
        down = time.monotonic()
        server.stop()
        before = len(steps)
        time.sleep(2.0)
        assert tracker.pending() > 0
        # training went on through the outage: a step every 10 ms, about 200 of them; a log_metrics that waited on
        # the server would hold its thread for the tracker's retries (0.5-2 s each)
        during = len(steps) - before
        server.start()
        outage = time.monotonic() - down
        time.sleep(1.0)
        stop.set()
        trainer.join()
        assert tracker.close(timeout_s=30) == 0

        from mlflow import MlflowClient

        client = MlflowClient(server.uri)
        assert outage > 5.0
        assert client.get_run(tracker.run_id).info.status == "FINISHED"
        assert steps_logged(client, tracker.run_id, "train/loss") == steps
        assert during >= 20, f"{during} steps logged in the 2 s the server was down"


@pytest.mark.integration
def test_the_report_reads_the_run_tracking_takes_for_each_key_and_names_runs_of_another_key_schema(tmp_path):
    from mlflow import MlflowClient

    from analysis.run_table import read_study
    from study.config.identity import SCHEMA_VERSION
    from study.track.query import runs_by_key

    uri = new_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    experiment = client.create_experiment("keys")

    def finished(key: str, schema: int, loss: float, start: int) -> str:
        tags = {"study.run_key": key, "study.key_schema": str(schema), "study.variant": "conventional",
                "study.scale": "tiny", "study.seed": "0"}
        run_id = client.create_run(experiment, start_time=start, run_name=f"{key[0]}-{start}", tags=tags).info.run_id
        client.log_metric(run_id, "val/loss", loss, step=8)
        client.set_terminated(run_id, "FINISHED")
        return run_id

    first = finished("a" * 12, SCHEMA_VERSION, 3.0, 1000)
    finished("a" * 12, SCHEMA_VERSION, 2.0, 2000)  # a later duplicate of the same key, as a race leaves one
    finished("b" * 12, SCHEMA_VERSION - 1, 1.0, 3000)  # trained by a version whose keys hashed other fields
    study = read_study("keys", uri)
    assert runs_by_key("keys", uri)["a" * 12].info.run_id == first
    assert study.runs[["run_id", "val/loss"]].values.tolist() == [[first, 3.0]]
    assert study.notes == (f"Left out 1 run(s) of another key schema (this version's is {SCHEMA_VERSION}): "
                           f"b-3000 (schema {SCHEMA_VERSION - 1}); relaunch the experiment (`study launch keys`) "
                           "to train them under the current keys.",)


@pytest.mark.integration
def test_a_report_of_failed_runs_says_they_failed_and_one_with_a_missing_cell_names_it(tmp_path):
    from mlflow import MlflowClient

    from analysis.run_table import read_study

    uri = new_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    failed, partial = client.create_experiment("failed"), client.create_experiment("partial")

    def ended(experiment: str, variant: str, scale: str, status: str) -> None:
        tags = {"study.run_key": f"{variant[0]}{scale[0]}" * 6, "study.variant": variant, "study.scale": scale,
                "study.seed": "0"}
        run_id = client.create_run(experiment, run_name=f"{variant}-{scale}", tags=tags).info.run_id
        if status == "FAILED":
            client.set_tag(run_id, "study.failure_reason", "non-finite val/loss at step 6")
        else:
            client.log_metric(run_id, "val/loss", 3.0, step=8)
        client.set_terminated(run_id, status)

    for variant in ("conventional", "hourglass"):
        ended(failed, variant, "tiny", "FAILED")
    with pytest.raises(StudyError) as refused:
        read_study("failed", uri)
    assert refused.value.field == "experiment" and refused.value.problem == (
        "every training run of MLflow experiment 'failed' failed (2 FAILED; conventional-tiny: non-finite val/loss "
        "at step 6; hourglass-tiny: non-finite val/loss at step 6)")
    assert "study.failure_reason" in refused.value.fix and "`study status failed`" in refused.value.fix

    for variant, scale in (("conventional", "tiny"), ("hourglass", "tiny"), ("conventional", "small")):
        ended(partial, variant, scale, "FINISHED")
    assert read_study("partial", uri).notes == ("No run of hourglass at small: these cells are in no comparison",)
    from analysis.report import analyse

    assert analyse("partial", tracking_uri=uri, baseline="conventional").run_notes == read_study("partial", uri).notes


def a_store_with_one_run(folder) -> str:
    from mlflow import MlflowClient

    folder.mkdir()
    uri = new_store(folder / "mlflow.db")
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("shelf"), tags={
        "study.run_key": "c" * 12, "study.variant": "conventional", "study.scale": "tiny", "study.seed": "0"})
    client.set_terminated(run.info.run_id, "FINISHED")
    return uri


@pytest.mark.integration
def test_a_store_on_a_read_only_file_system_is_read_without_a_lock_file(tmp_path):
    from analysis.run_table import read_runs
    from study.track.query import runs_by_key

    folder = tmp_path / "shelf"
    uri = a_store_with_one_run(folder)
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(folder), str(folder)]).returncode:
        pytest.skip("a read-only bind mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        assert {k: r.info.status for k, r in runs_by_key("shelf", uri).items()} == {"c" * 12: "FINISHED"}  # status
        assert read_runs("shelf", uri)["run_key"].tolist() == ["c" * 12]  # what `study report` reads
        assert sorted(p.name for p in folder.iterdir()) == ["mlflow.db"]
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.integration
def test_a_store_a_writer_holds_locked_is_read_once_it_lets_go(tmp_path):
    from study.track.query import runs_by_key

    uri = a_store_with_one_run(tmp_path / "busy")
    writer = sqlite3.connect(tmp_path / "busy" / "mlflow.db", check_same_thread=False)
    writer.execute("BEGIN EXCLUSIVE")  # readers wait; SQLite's own wait (5 s) runs out before the writer lets go
    release = threading.Timer(8.0, writer.commit)
    release.start()
    started = time.monotonic()
    try:
        assert {k: r.info.status for k, r in runs_by_key("shelf", uri).items()} == {"c" * 12: "FINISHED"}
    finally:
        release.join()
        writer.close()
    assert time.monotonic() - started >= 8.0


def test_an_artifact_the_store_refused_waits_in_the_run_directory_and_the_next_start_sends_it(tmp_path):
    """An artifact store that cannot take files (here its folder is a file: a permanent error, as a full file
    system is) keeps every metric point; the artifact waits in the run directory's outbox, the close says so, and
    the run's next start sends it: the run page ends up with it, and the outbox is gone."""
    from mlflow import MlflowClient

    from study.config.tracking import TrackingConfig
    from study.track.tracker import ARTIFACT_OUTBOX
    from study.track.tracker import Tracker

    uri = new_store(tmp_path / "mlflow.db")
    blocked = tmp_path / "artifacts"
    blocked.write_text("not a folder")
    MlflowClient(uri).create_experiment("outbox", artifact_location=str(blocked / "store"))
    cfg = TrackingConfig(uri=uri, open_timeout_s=20, retry_initial_s=0.05, retry_max_s=0.1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tracker = Tracker.open("k" * 12, "outbox", "r", cfg=cfg, log_path=run_dir / "metrics.jsonl")
    tracker.log_metrics({"train/loss": 2.0}, 1)
    tracker.log_dict({"a": 1}, "config.yaml")
    tracker.close("FINISHED")
    waiting = [p for p in (run_dir / ARTIFACT_OUTBOX).rglob("config.yaml")]
    assert len(waiting) == 1 and waiting[0].read_text() == "a: 1\n"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("outbox").experiment_id])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2.0]
    blocked.unlink()  # space again
    blocked.mkdir()
    again = Tracker.open("k" * 12, "outbox", "r", cfg=cfg, log_path=run_dir / "metrics.jsonl")
    assert again.run_id == run.info.run_id
    again.close("FINISHED")
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]
    assert not (run_dir / ARTIFACT_OUTBOX).exists()


@pytest.fixture
def silent_server():
    """A tracking server that takes each connection and hangs up without a word, counting them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    taken: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed at teardown
                return
            taken.append(1)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", taken
    sock.close()


def test_plan_beside_a_server_that_does_not_answer_plans_with_the_prior_and_says_so_in_one_line(
        workdir, silent_server, monkeypatch, capsys):
    from study.cli import main

    uri, taken = silent_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main(["plan", "demo"]) == 0
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line == (f"study plan: the MLflow server {uri} does not answer (it closed the connection without a "
                    "reply); planned with decision.prior_sd and the assumed throughput instead of the store's "
                    "measurements")
    assert "demo:" in out and "prior" in out and "does not answer" in out  # the plan, its power table from the prior
    assert len(taken) == 1  # one probe: neither the noise nor the throughput reader asks again


def test_eval_refuses_at_once_when_its_server_does_not_answer_asking_it_once(workdir, silent_server, monkeypatch,
                                                                             capsys):
    from conftest import TINY
    from study.cli import main
    from study.config.spec import write_spec
    from study.plan.planner import select_run

    spec = select_run([*TINY, "experiment=probe"])
    write_spec(spec)  # planned, never trained: the refusal comes before any checkpoint is looked for
    uri, taken = silent_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main(["eval", spec.key, "tasks=arc_easy_local"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"study eval: error in `tracking.uri`: the MLflow server {uri} does not answer ("), err
    assert err.rstrip().endswith("Fix: start the tracking server (`mlflow server`), or point tracking.uri (or "
                                 "MLFLOW_TRACKING_URI) at a reachable store")
    assert len(taken) == 1 and not spec.run_dir.evals.exists()
