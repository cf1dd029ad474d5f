"""Fault injection without a scheduler: killed processes, half-written checkpoints, a full disk, an unwritable run
directory, a diverging run in a sweep, and a tracking-server outage. Every fault ends with the result of the
uninterrupted run, one MLflow run per key and a complete, duplicate-free metric history."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import TINY, TRAINING_RUNS, new_store
from study.cli import main
from study.plan.planner import plan_experiment, select_run
from study.train.loop import train

pytestmark = pytest.mark.faults

STEPS = 24
COMMON = [*TINY, "experiment=faults", f"train.max_steps={STEPS}", "train.ckpt_interval=3", "train.val_interval=6"]


def history(db: str, experiment: str = "faults", key: str = "train/loss"):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=TRAINING_RUNS)
    return runs, {r.info.run_id: sorted(m.step for m in client.get_metric_history(r.info.run_id, key)) for r in runs}


def reference_result(workdir) -> float:
    out = train(select_run([*COMMON, "paths.runs=clean", f"tracking.uri={new_store(workdir / 'clean.db')}"]))
    assert out.status == "FINISHED"
    return out.val_loss


@pytest.mark.integration
def test_sigkill_at_random_steps_resumes_to_the_uninterrupted_result(workdir):
    want = reference_result(workdir)
    rng = random.Random(7)
    cmd = [sys.executable, "-m", "study.cli", "train", *COMMON, "faults.sleep_per_step=0.15"]
    kills = 0
    for target in sorted(rng.sample(range(4, STEPS - 3), 3)):
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            found = list(workdir.glob("runs/faults/*/checkpoints/step_*"))
            done = [int(p.name.split("_")[1]) for p in found if not p.name.endswith(".partial")]
            if done and max(done) >= target:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.3))  # land anywhere in the step, a save included
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills == 3
    final = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-2000:]
    (result,) = workdir.glob("runs/faults/*/result.json")
    assert json.loads(result.read_text())["val_loss"] == want
    runs, steps = history(f"{workdir}/mlflow.db")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert list(steps.values())[0] == list(range(1, STEPS + 1))  # complete and duplicate-free
    assert int(runs[0].data.tags["study.restarts"]) == 3


@pytest.fixture
def small_disk(workdir):
    """A file system that really fills up: a 64 MiB tmpfs in the working directory (mounting needs root)."""
    disk = workdir / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def resize(disk, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)


def test_a_file_written_whole_on_a_full_disk_keeps_its_old_content_and_leaves_no_partial_copy(small_disk):
    """`replace_file` (run specs, launch records, result files): the write fails with ENOSPC, the file still holds
    what it held, and the hidden copy it was writing is gone."""
    import errno

    from study.files import replace_file

    target = small_disk / "run.json"
    replace_file(target, "old")
    resize(small_disk, 1 << 20)
    with pytest.raises(OSError) as err:
        replace_file(target, "x" * (2 << 20))
    assert err.value.errno == errno.ENOSPC
    assert target.read_text() == "old" and sorted(p.name for p in small_disk.iterdir()) == ["run.json"]


@pytest.mark.integration
def test_a_full_disk_fails_the_run_naming_it_and_its_half_written_checkpoint_is_never_loaded(workdir, small_disk,
                                                                                               capsys):
    from study.train import checkpoint

    want = reference_result(workdir)
    over = [*COMMON, f"paths.runs={small_disk}"]
    assert train(select_run([*over, "faults.stop_at_step=6"])).status == "PREEMPTED"
    (rdir,) = small_disk.glob("faults/*")
    size = sum(f.stat().st_size for f in (rdir / "checkpoints" / "step_00000006").iterdir())
    resize(small_disk, shutil.disk_usage(small_disk).used + size // 2)  # the next metric points fit, step 9 does not
    capsys.readouterr()
    assert main(["train", *over]) == 2
    err = capsys.readouterr().err
    assert f"error in `paths.runs`: no space left on {rdir} (writing {rdir}/checkpoints/step_00000009.partial" in err
    assert "resumes from step_00000006" in err and "Traceback" not in err
    assert [p.name for p in (rdir / "checkpoints").glob("*.partial")] == ["step_00000009.partial"]
    assert checkpoint.latest(rdir).name == "step_00000006"  # the half-written one never counts
    runs, _ = history(f"{workdir}/mlflow.db")
    assert runs[0].info.status == "FAILED" and "No space left" in runs[0].data.tags["study.failure_reason"]

    resize(small_disk, 64 << 20)  # space freed: the run resumes from step 6
    out = train(select_run(over))
    assert out.status == "FINISHED" and out.val_loss == want and min(out.losses) == 7
    assert not list((rdir / "checkpoints").glob("*.partial"))
    runs, steps = history(f"{workdir}/mlflow.db")
    assert len(runs) == 1 and list(steps.values())[0] == list(range(1, STEPS + 1))


def test_a_full_data_cache_is_refused_naming_data_cache_dir(workdir, small_disk, capsys):
    resize(small_disk, 256 << 10)
    assert main(["prepare", *TINY, f"data.cache_dir={small_disk}"]) == 2
    err = capsys.readouterr().err
    assert f"error in `data.cache_dir`: no space left on {small_disk}" in err and "Traceback" not in err
    resize(small_disk, 64 << 20)
    assert main(["prepare", *TINY, f"data.cache_dir={small_disk}"]) == 0


def test_a_non_finite_validation_loss_fails_the_run_with_its_step(workdir, capsys):
    # a step this large makes the weights overflow within two steps; the training loss is only read at step 100
    over = [*COMMON, "train.lr=1000", "train.grad_clip=0", "train.log_interval=100", "train.val_interval=2"]
    assert main(["train", *over]) == 1
    assert "FAILED at step 2: validation loss is nan at step 2" in capsys.readouterr().err
    runs, steps = history(f"{workdir}/mlflow.db", key="val/loss")
    assert [r.info.status for r in runs] == ["FAILED"] and list(steps.values()) == [[]]
    assert runs[0].data.tags["study.failure_reason"] == "validation loss is nan at step 2"
    assert not list(workdir.glob("runs/faults/*/result.json"))


@pytest.mark.no_store
def test_unwritable_run_directory_is_refused_before_anything_is_tracked(workdir):
    from study.errors import StudyError

    with pytest.raises(StudyError) as err:
        train(select_run([*COMMON, "paths.runs=/proc/study-runs"]))
    assert err.value.field == "paths.runs"
    assert not (workdir / "mlflow.db").exists()


@pytest.mark.integration
def test_nan_in_one_run_of_a_sweep_fails_it_with_the_reason_and_its_siblings_finish(workdir, monkeypatch):
    from slurm_helpers import private_sweeps
    from study.launch.submit import LaunchFailed, launch

    variants = {"conventional": {"model": "conventional"},
                # a variant of its own (fault settings alone would not make it another run)
                "diverging": {"model": "conventional", "set": {"faults.nan_at_step": 5, "train.weight_decay": 0.05}}}
    private_sweeps(workdir, "nan_sweep", variants=variants, seeds=[0, 1], compares=["train.weight_decay"])
    monkeypatch.setenv("STUDY_SWEEPS", str(workdir / "sweeps"))
    with pytest.raises(LaunchFailed) as failed:  # the launch says which runs failed, and why
        launch("nan_sweep", ["cluster=local"], echo=lambda m: None)
    message = str(failed.value)
    assert message.startswith("2 of 4 runs failed: ")
    plan = {r.name: r for r in plan_experiment("nan_sweep", ["cluster=local"]).runs}
    for name in ("diverging-tiny-s0", "diverging-tiny-s1"):  # the reason itself, then where the log is
        assert re.search(rf"{name} \({plan[name].key}\): training loss is nan at step 5 \(log: /\S+_log\.err\)",
                         message)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("nan_sweep").experiment_id], filter_string=TRAINING_RUNS)
    by_variant = {}
    for r in runs:
        by_variant.setdefault(r.data.tags["study.variant"], []).append(r)
    assert [r.info.status for r in by_variant["conventional"]] == ["FINISHED", "FINISHED"]
    assert [r.info.status for r in by_variant["diverging"]] == ["FAILED", "FAILED"]
    assert all("nan" in r.data.tags["study.failure_reason"].lower() for r in by_variant["diverging"])


@pytest.mark.integration
@pytest.mark.mlflow_server
def test_tracking_server_down_for_30_s_loses_no_point_and_duplicates_no_run(workdir):
    from mlflow import MlflowClient

    from mlflow_server import start_server

    server = start_server(new_store(workdir / "server.db"), str(workdir / "artifacts"))
    try:
        cmd = [sys.executable, "-m", "study.cli", "train", *COMMON, "train.max_steps=60",
               "faults.sleep_per_step=0.8", f"tracking.uri={server.uri}", "tracking.flush_interval_s=0.5"]
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while not list(workdir.glob("runs/faults/*/checkpoints/step_00000003")):
            time.sleep(0.2)
        server.stop()
        outage_start = time.time()
        time.sleep(30)
        assert proc.poll() is None  # training went on during the outage
        server.start()
        outage = time.time() - outage_start
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        client = MlflowClient(server.uri)
        runs = client.search_runs([client.get_experiment_by_name("faults").experiment_id], filter_string=TRAINING_RUNS)
        assert len(runs) == 1 and runs[0].info.status == "FINISHED" and outage >= 30
        for key in ("train/loss", "train/lr"):
            steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, key)]
            assert sorted(steps) == list(range(1, 61)), key
        assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "val/loss")] == [6 * i for i in range(1, 11)]
    finally:
        server.stop()
