"""The run directory is the source of truth and one process trains a key: concurrent launches, a launcher stopped by
PID, a store swapped or emptied, an outage then a kill, re-evaluation, broken checkpoints and cache entries, and the
safety of what reaches disk, scripts and sockets. Each asserts the exact logged steps and one MLflow run per key."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import TINY, TRAINING_RUNS, new_store
from slurm_helpers import private_sweeps
from study.errors import StudyError
from study.plan.planner import select_run
from study.train.loop import train

pytestmark = pytest.mark.faults

STEPS = 12
RUN = [*TINY, "experiment=rel", f"train.max_steps={STEPS}", "train.ckpt_interval=4", "train.val_interval=6"]


def store(db) -> "object":
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{db}")


def runs_of(db, experiment):
    client = store(db)
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id], filter_string=TRAINING_RUNS) if exp else [])


def steps(client, run, key="train/loss"):
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


def cli(*argv, cwd, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "study.cli", *argv], cwd=cwd, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.integration
def test_two_launches_started_together_train_each_key_once(workdir):
    tree = private_sweeps(workdir, "twice", seeds=[0, 1], variants={"conventional": {"model": "conventional"}})
    env = {"STUDY_SWEEPS": str(tree)}
    over = ["cluster=local", "train.max_steps=10", "faults.sleep_per_step=0.1"]
    a, b = cli("launch", "twice", *over, cwd=workdir, env=env), cli("launch", "twice", *over, cwd=workdir, env=env)
    outs = [p.communicate(timeout=600) for p in (a, b)]
    assert a.returncode == 0 and b.returncode == 0, [o[1][-2000:] for o in outs]
    client, runs = runs_of(workdir / "mlflow.db", "twice")
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    assert len({r.data.tags["study.run_key"] for r in runs}) == 2
    for run in runs:
        assert steps(client, run) == list(range(1, 11))  # every step once, none twice


@pytest.mark.integration
def test_a_launcher_stopped_by_its_pid_stops_its_runs_and_a_relaunch_finishes_them(workdir):
    tree = private_sweeps(workdir, "stopme", variants={"conventional": {"model": "conventional"}})
    env = {"STUDY_SWEEPS": str(tree)}
    over = ["cluster=local", "train.max_steps=30", "train.ckpt_interval=3"]
    launcher = cli("launch", "stopme", *over, "faults.sleep_per_step=0.3", cwd=workdir, env=env)
    deadline = time.time() + 300
    while not list(workdir.glob("runs/stopme/*/checkpoints/step_00000003")) and time.time() < deadline:
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)  # the launcher's PID only, not its process group
    launcher.communicate(timeout=300)
    assert launcher.returncode == 128 + signal.SIGTERM
    (rdir,) = [p.parent for p in workdir.glob("runs/stopme/*/run.json")]
    from study.train.lease import Lease

    lease = Lease(rdir)
    assert lease.try_acquire()  # no trainer is left holding the run
    lease.release()
    client, (run,) = runs_of(workdir / "mlflow.db", "stopme")
    assert run.info.status == "KILLED"
    again = cli("launch", "stopme", *over, cwd=workdir, env=env)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    client, (run,) = runs_of(workdir / "mlflow.db", "stopme")
    assert run.info.status == "FINISHED" and steps(client, run) == list(range(1, 31))


@pytest.mark.integration
def test_a_finished_run_trained_against_an_empty_store_brings_every_point(workdir):
    first = train(select_run(RUN))
    assert first.status == "FINISHED"
    client, (old,) = runs_of(workdir / "mlflow.db", "rel")
    want = {k: [(m.step, m.value) for m in sorted(client.get_metric_history(old.info.run_id, k), key=lambda m: m.step)]
            for k in ("train/loss", "train/lr", "val/loss", "val/ppl")}
    again = train(select_run([*RUN, f"tracking.uri={new_store(workdir / 'other.db')}"]))
    assert again.status == "FINISHED" and again.val_loss == first.val_loss
    client, (new,) = runs_of(workdir / "other.db", "rel")
    assert new.info.status == "FINISHED" and new.data.tags["study.run_key"] == old.data.tags["study.run_key"]
    got = {k: [(m.step, m.value) for m in sorted(client.get_metric_history(new.info.run_id, k), key=lambda m: m.step)]
           for k in want}
    assert got == want


@pytest.mark.integration
@pytest.mark.mlflow_server
def test_an_outage_then_a_kill_loses_no_point(workdir):
    from mlflow_server import start_server

    server = start_server(new_store(workdir / "server.db"), str(workdir / "artifacts"))
    cmd = ["train", *RUN, "train.max_steps=24", "train.ckpt_interval=2", "faults.sleep_per_step=0.25",
           f"tracking.uri={server.uri}", "tracking.flush_interval_s=0.2", "tracking.checkpoint_flush_s=0.5"]
    env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    try:
        proc = cli(*cmd, cwd=workdir, env=env)
        deadline = time.time() + 300
        while not list(workdir.glob("runs/rel/*/checkpoints/step_00000004")) and time.time() < deadline:
            time.sleep(0.1)
        server.stop()  # the outage: points after here only reach the run directory's log
        while not list(workdir.glob("runs/rel/*/checkpoints/step_00000012")) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.4)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        server.restart()
        done = cli(*cmd, cwd=workdir, env=env)
        _, err = done.communicate(timeout=600)
        assert done.returncode == 0, err[-2000:]
        from mlflow import MlflowClient

        client = MlflowClient(server.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("rel").experiment_id], filter_string=TRAINING_RUNS)
        assert run.info.status == "FINISHED" and steps(client, run) == list(range(1, 25))
    finally:
        server.stop()


@pytest.mark.integration
def test_a_re_evaluation_with_other_settings_is_a_record_of_its_own_in_mlflow_and_files(workdir, capsys, tmp_path):
    from study.cli import main
    from study.eval.records import read_records
    from study.schema import EVAL_RECORD, TAG_EVAL, eval_artifact

    spec = select_run([*RUN, "model.max_seq_len=128", "data.seq_len=32", "eval.limit=4"])
    assert train(spec).status == "FINISHED"
    capsys.readouterr()
    assert main(["eval", spec.key, "tasks=arc_easy_local"]) == 0  # the configured evaluation: 4 documents
    four = json.loads(capsys.readouterr().out)
    assert main(["eval", spec.key, "tasks=arc_easy_local", "limit=8"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert (four["of_record"], eight["of_record"]) == (True, False) and four["id"] != eight["id"]
    assert main(["eval", spec.key, "tasks=arc_easy_local"]) == 0  # the same settings: the same record again
    assert json.loads(capsys.readouterr().out)["metrics"] == four["metrics"]

    records = {r["limit"]: r for r in read_records(spec)}
    assert sorted(records) == [4, 8] and records[8] == eight
    assert [r["tasks_summary"]["arc_easy_local"]["items"] for r in (records[4], records[8])] == [4, 8]
    client, (run,) = runs_of(workdir / "mlflow.db", "rel")
    # the run's eval/* scores stay the configured evaluation's; the other one sits beside them under its id
    assert four["metrics"].keys() == {k for k in run.data.metrics if k.startswith("eval/")}
    assert eight["metrics"].keys() == {k for k in run.data.metrics if k.startswith(f"evals/{eight['id']}/")}
    assert {k: run.data.metrics[k] for k in [*four["metrics"], *eight["metrics"]]} == {**four["metrics"],
                                                                                      **eight["metrics"]}
    # the configured evaluation repeated added no second point
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/arc_easy_local/acc")] == [
        (STEPS, four["metrics"]["eval/arc_easy_local/acc"])]
    assert run.data.tags[TAG_EVAL + "arc_easy_local"] == four["id"]
    for record in (four, eight):
        logged = client.download_artifacts(run.info.run_id, eval_artifact(record["id"], EVAL_RECORD),
                                           str(tmp_path / record["id"]))
        assert json.loads(open(logged).read())["metrics"] == record["metrics"]


@pytest.mark.integration
def test_a_broken_newest_checkpoint_falls_back_to_the_previous_one(workdir, capsys):
    clean = train(select_run([*RUN, "paths.runs=clean", f"tracking.uri={new_store(workdir / 'clean.db')}"]))
    spec = select_run([*RUN, "faults.stop_at_step=8"])
    assert train(spec).status == "PREEMPTED"
    newest = spec.run_dir.checkpoints / "step_00000008"
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated
    capsys.readouterr()
    out = train(select_run(RUN))
    err = capsys.readouterr().err
    assert "step_00000008" in err and "falling back" in err
    assert out.status == "FINISHED" and min(out.losses) == 5  # resumed from step 4
    assert out.losses == {s: v for s, v in clean.losses.items() if s >= 5} and out.val_loss == clean.val_loss
    client, (run,) = runs_of(workdir / "mlflow.db", "rel")
    assert steps(client, run) == list(range(1, STEPS + 1))


def test_a_checkpoint_or_spec_of_another_run_is_refused_by_name(workdir):
    a = select_run([*RUN, "train.max_steps=4"])
    b = select_run([*RUN, "train.max_steps=4", "seed=1"])
    assert train(a).status == "FINISHED"
    b.run_dir.checkpoints.mkdir(parents=True)
    shutil.copytree(a.run_dir.checkpoints / "step_00000004", b.run_dir.checkpoints / "step_00000004")
    with pytest.raises(StudyError, match=f"belongs to run {a.key}"):
        train(b)
    shutil.rmtree(b.run_dir.checkpoints)
    shutil.copyfile(a.run_dir.spec, b.run_dir.spec)
    with pytest.raises(StudyError, match=f"holds run {a.key}"):
        train(b)
    from study.eval.locate import find_run

    with pytest.raises(StudyError, match=f"holds the spec of run {a.key}"):
        find_run(b.key)


@pytest.mark.integration
def test_a_damaged_shard_entry_is_rebuilt_not_trusted(workdir, capsys):
    import numpy as np

    from study.data import prepare_data

    cfg = select_run([*RUN, f"data.cache_dir={workdir / 'own-cache'}"]).config.data  # not the shared cache
    first = prepare_data(cfg)
    want = np.array(first.train)
    path = first.shard_dir / "train.bin"
    damaged = np.memmap(path, dtype=first.train.dtype, mode="r+")
    damaged[:50] = (damaged[:50] + 1) % 100  # still valid ids, so only the checksum can tell
    damaged.flush()
    del damaged, first
    capsys.readouterr()
    again = prepare_data(cfg)
    assert "damaged" in capsys.readouterr().err
    assert np.array_equal(np.array(again.train), want)


def test_secrets_never_reach_run_directories_params_or_artifacts(workdir):
    secret = "hunter2-do-not-log"
    spec = select_run([*RUN, "train.max_steps=2", f"cluster.setup=['export HF_TOKEN={secret}']",
                       "data.eos_token='<|endoftext|>'"])
    assert train(spec).status == "FINISHED"
    for path in spec.run_dir.path.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".yaml", ".jsonl"):
            assert secret not in path.read_text(), path
    client, (run,) = runs_of(workdir / "mlflow.db", "rel")
    assert secret not in json.dumps(run.data.params) and run.data.params["data.eos_token"] == "<|endoftext|>"
    for name in ("config.yaml", "run.json"):
        local = client.download_artifacts(run.info.run_id, name, str(workdir))
        text = open(local).read()
        assert secret not in text and "HF_TOKEN=***" in text


@pytest.mark.integration
def test_a_crafted_rng_file_is_not_unpickled(workdir):
    spec = select_run([*RUN, "faults.stop_at_step=4"])
    assert train(spec).status == "PREEMPTED"
    marker = workdir / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (spec.run_dir.checkpoints / "step_00000004" / "rng_rank0.pt").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(StudyError, match=r"no checkpoint of run \w+ loads: step_00000004 \(UnpicklingError"):
        train(select_run(RUN))  # refused as a damaged checkpoint, the only one
    assert not marker.exists()


LOOPBACK = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1 and ::1 as /proc/net/tcp* write them


def listening_sockets(pids: list[int]) -> list[str]:
    """Local addresses of TCP sockets in LISTEN state owned by `pids` (their fds matched to /proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                out.append(cols[1])
    return out


@pytest.mark.integration
@pytest.mark.distributed
def test_local_ranks_listen_on_loopback_only(workdir):
    proc = cli("train", "--nproc", "2", *RUN, "train.max_steps=40", "faults.sleep_per_step=0.2",
               "train.global_batch=8", cwd=workdir)
    try:
        deadline = time.time() + 300
        while not list(workdir.glob("runs/rel/*/checkpoints/step_00000004")) and time.time() < deadline:
            time.sleep(0.2)
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 2
        listening = listening_sockets(children)
        assert [a for a in listening if a.split(":")[0] not in LOOPBACK] == []  # nothing reachable from outside
    finally:
        proc.send_signal(signal.SIGTERM)  # the parent only: it stops its ranks
        proc.communicate(timeout=300)
    assert proc.returncode == 75


@pytest.mark.integration
def test_a_run_whose_evaluation_failed_is_evaluated_by_the_relaunch(workdir, monkeypatch):
    from study.launch.submit import LaunchFailed, launch
    from study.plan.planner import plan_experiment

    tree = private_sweeps(workdir, "evalfail", variants={"conventional": {"model": "conventional"}})
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    over = ["cluster=local", "train.max_steps=4", "model.max_seq_len=128", "eval.after_train=true",
            "eval.limit=4", "eval.tasks=[arc_easy_local]"]
    (spec,) = plan_experiment("evalfail", over).runs
    spec.run_dir.path.mkdir(parents=True)
    spec.run_dir.evals.write_text("a file where the evaluation records go")  # the evaluation cannot write
    with pytest.raises(LaunchFailed, match="1 of 1 runs failed"):
        launch("evalfail", over, echo=lambda m: None)
    client, (run,) = runs_of(workdir / "mlflow.db", "evalfail")
    assert run.info.status == "FINISHED" and not any(k.startswith("eval/") for k in run.data.metrics)
    spec.run_dir.evals.unlink()
    launch("evalfail", over, echo=lambda m: None)  # training is done: only the evaluation runs
    client, (run,) = runs_of(workdir / "mlflow.db", "evalfail")
    assert "eval/arc_easy_local/acc" in run.data.metrics and steps(client, run) == [1, 2, 3, 4]
    assert launch("evalfail", over, echo=lambda m: None) == []  # trained and evaluated: nothing to do


def test_a_truncated_journal_line_and_a_damaged_store_are_handled(workdir, capsys):
    from study.cli import main
    from study.launch.scheduler import journal, record

    record("runs", "demo", [{"key": "a" * 12, "job_id": "7", "scheduler": "slurm"}])
    with open(workdir / "runs" / "demo" / "_launch" / "jobs.jsonl", "a") as f:
        f.write('{"key": "bbbbbbbbbbbb", "job_')  # a launcher killed mid-write
    assert journal("runs", "demo") == {"a" * 12: {"key": "a" * 12, "job_id": "7", "scheduler": "slurm"}}
    (workdir / "mlflow.db").write_bytes(b"this is not an sqlite database" * 100)
    assert main(["status", "demo"]) == 2
    err = capsys.readouterr().err
    assert "`tracking.uri`" in err and "Traceback" not in err


def test_submissions_from_inside_a_job_leave_that_allocations_slurm_variables_behind(monkeypatch):
    import os

    from study.launch.scheduler import outside_allocation

    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "4096")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SBATCH_ACCOUNT", "lab")
    with outside_allocation():
        assert "SLURM_MEM_PER_NODE" not in os.environ and "SLURM_JOB_ID" not in os.environ
        assert os.environ["SLURM_CONF"] == "/etc/slurm/slurm.conf" and os.environ["SBATCH_ACCOUNT"] == "lab"
    assert os.environ["SLURM_MEM_PER_NODE"] == "4096" and os.environ["SLURM_JOB_ID"] == "9"
