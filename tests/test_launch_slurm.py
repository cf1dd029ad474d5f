"""Sweeps on the real local SLURM cluster: arrays, idempotent relaunch, resume of a failed run, preemption,
requeue, and a 2-task FSDP job. Needs `slurm/local/up` (scripts/test starts it)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from conftest import TRAINING_RUNS
from slurm_helpers import SMALL, private_sweeps, slurm_available, wait_jobs

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"),
              pytest.mark.skipif(not slurm_available(), reason="no SLURM cluster: run `eval \"$(slurm/local/up)\"`")]


@pytest.fixture
def cluster_env(workdir, monkeypatch):
    """Jobs inherit the environment: the data cache, the sweeps copy, and the tracking store."""
    uri = os.environ.get("STUDY_TEST_MLFLOW_URI")
    if uri:  # the real server scripts/test started: concurrent jobs log over HTTP
        experiment_suffix = f"_{int(time.time() * 1000) % 10**8}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    else:
        experiment_suffix = ""
    monkeypatch.setenv("STUDY_SWEEPS", str(workdir / "sweeps"))
    return experiment_suffix


def mlflow_runs(experiment):
    from study.track.store import mlflow_client
    from study.track.store import resolve_tracking_uri

    client = mlflow_client(resolve_tracking_uri(""))
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else [r for r in client.search_runs([exp.experiment_id], filter_string=TRAINING_RUNS)
                                   if r.data.tags.get("study.stage") != "report"]


def job_ids(stages):
    return [j for s in stages for j in s.job_ids]


def test_launch_relaunch_and_resume_of_a_cancelled_run(workdir, cluster_env):
    from study.launch.scheduler import journal
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment
    from study.launch.status import experiment_status

    name = "small" + cluster_env
    private_sweeps(workdir, name, common={**SMALL["common"],
                                          "faults": {"sleep_per_step": 0.4}})
    over = ["cluster=slurm"]
    stages = launch(name, over, echo=lambda m: None)
    # the session's data cache may not hold these shards yet: then a prepare job comes first
    assert [s.name for s in stages if s.name != "prepare"] == ["train"] and len(stages[-1].runs) == 2
    plan = plan_experiment(name, over)
    victim = next(r for r in plan.runs if r.cfg.variant == "hourglass")
    victim_job = journal(plan.runs[0].config.paths.runs, name)[victim.key]["job_id"]
    ckpts = workdir / "runs" / name / victim.key / "checkpoints"
    deadline = time.time() + 300
    while not any(p.name == "step_00000004" for p in ckpts.glob("step_*")) and time.time() < deadline:
        time.sleep(0.5)
    assert time.time() < deadline, "the victim never wrote its first checkpoint"
    subprocess.run(["scancel", victim_job], check=True)
    wait_jobs(job_ids(stages))

    status = {s.key: s for s in experiment_status(name, over)}
    assert status[victim.key].verdict.startswith("died") or status[victim.key].mlflow in ("KILLED", "FAILED")
    assert status[victim.key].last_step is not None and status[victim.key].last_step >= 4

    again = launch(name, over, echo=lambda m: None)
    assert [r.key for s in again for r in s.runs] == [victim.key]  # exactly the cancelled run
    wait_jobs(job_ids(again))

    runs = mlflow_runs(name)
    keys = [r.data.tags["study.run_key"] for r in runs]
    assert sorted(keys) == sorted(r.key for r in plan.runs)  # one MLflow run per planned key
    assert all(r.info.status == "FINISHED" for r in runs)
    from mlflow import MlflowClient

    resumed = next(r for r in runs if r.data.tags["study.run_key"] == victim.key)
    assert int(resumed.data.tags["study.restarts"]) >= 1
    steps = [m.step for m in MlflowClient().get_metric_history(resumed.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 17))  # resumed, nothing lost, nothing twice
    assert launch(name, over, echo=lambda m: None) == []  # everything finished: nothing to submit


def test_usr2_preemption_and_scontrol_requeue_end_with_the_uninterrupted_val_loss(workdir, cluster_env, monkeypatch):
    import json

    from study.launch.scheduler import journal
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    name = "small" + cluster_env
    common = {**SMALL["common"], "faults": {"sleep_per_step": 0.4}}
    private_sweeps(workdir, name, common=common, seeds=[0, 1], variants={"conventional": {"model": "conventional"}})
    over = ["cluster=slurm"]
    stages = launch(name, over, echo=lambda m: None)
    plan = plan_experiment(name, over)
    jobs = journal(plan.runs[0].config.paths.runs, name)
    a, b = [r for r in plan.runs if r.cfg.variant == "conventional"]
    deadline = time.time() + 300
    for run in (a, b):  # both past their first checkpoint, neither finished
        ckpts = workdir / "runs" / name / run.key / "checkpoints"
        while not any(p.name.endswith("04") for p in ckpts.glob("step_*")):
            assert time.time() < deadline, f"{run.name} never wrote its first checkpoint"
            time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR2", jobs[a.key]["job_id"]], check=True)
    subprocess.run(["scontrol", "requeue", jobs[b.key]["job_id"]], check=True)
    wait_jobs(job_ids(stages), timeout=900)
    time.sleep(3)
    wait_jobs(job_ids(stages), timeout=900)  # a requeued job is pending again before it restarts

    # the same two runs, uninterrupted, in a separate runs folder and store (launch-only settings: same keys)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/clean.db")
    clean = launch(name, over + ["paths.runs=clean", "faults.sleep_per_step=0"], echo=lambda m: None)
    wait_jobs(job_ids(clean))
    for run in (a, b):
        got = json.loads((workdir / "runs" / name / run.key / "result.json").read_text())
        want = json.loads((workdir / "clean" / name / run.key / "result.json").read_text())
        assert got["val_loss"] == want["val_loss"] and got["step"] == want["step"] == 16


def test_two_task_slurm_job_trains_with_fsdp_over_gloo(workdir, cluster_env):
    from study.launch.submit import launch

    name = "small" + cluster_env
    private_sweeps(workdir, name, variants={"conventional": {"model": "conventional"}},
                   common={**SMALL["common"]})
    stages = launch(name, ["cluster=slurm", "cluster.tasks_per_node=2", "train.global_batch=8"], echo=lambda m: None)
    states = wait_jobs(job_ids(stages))
    assert set(states.values()) == {"COMPLETED"}, states
    (run,) = mlflow_runs(name)
    assert run.info.status == "FINISHED" and run.data.tags["study.world_size"] == "2"


def test_hydra_multirun_on_slurm_trains_every_grid_point(workdir, cluster_env):
    import sys

    from conftest import TINY, TRAINING_RUNS

    cmd = [sys.executable, "-m", "study.train", "-m", "hydra/launcher=study_slurm", "seed=0,1",
           *[o for o in TINY if not o.startswith("scale=")], "scale=tiny", "train.max_steps=6",
           f"hydra.job.name=hygrid{cluster_env}"]
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "STUDY_SWEEPS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    runs = mlflow_runs(f"hygrid{cluster_env}")
    assert sorted(r.info.run_name for r in runs) == ["conventional-tiny-s0", "conventional-tiny-s1"]
    assert all(r.info.status == "FINISHED" and r.data.tags.get("study.slurm_job_id") for r in runs)


def test_time_limit_warning_checkpoints_and_requeues_until_the_run_is_done(workdir, cluster_env, monkeypatch):
    """A 2-minute job limit with USR2 45 s before it: SLURM may send the warning up to 60 s early (sbatch(1)), so it
    lands 15-75 s into each leg, never before the job's signal handlers exist; the 80 s of training outlast it, so
    at least one leg is cut, and the run still ends with the val/loss of an uninterrupted run."""
    import json

    from study.launch.submit import launch
    from study.plan.planner import plan_experiment
    from study.train.loop import train

    name = "small" + cluster_env
    common = {**SMALL["common"], "train": {**SMALL["common"]["train"], "max_steps": 20},
              "faults": {"sleep_per_step": 4.0}}
    private_sweeps(workdir, name, common=common, variants={"conventional": {"model": "conventional"}})
    over = ["cluster=slurm", "cluster.time_min=2", "cluster.signal_delay_s=45", "cluster.max_requeues=8"]
    stages = launch(name, over, echo=lambda m: None)
    wait_jobs(job_ids(stages), timeout=900)
    (run,) = mlflow_runs(name)
    assert run.info.status == "FINISHED" and int(run.data.tags["study.restarts"]) >= 1
    (planned,) = plan_experiment(name, over).runs
    clean = train(plan_experiment(name, over + ["paths.runs=clean", f"tracking.uri=sqlite:///{workdir}/c.db",
                                                "faults.sleep_per_step=0"]).runs[0])
    got = json.loads((workdir / "runs" / name / planned.key / "result.json").read_text())
    assert got["val_loss"] == clean.val_loss


def test_until_decided_on_slurm_runs_its_loop_in_a_controller_job(workdir, cluster_env, capsys):
    from analysis.sequential import read_looks
    from study.cli import main
    from study.track.store import mlflow_client, resolve_tracking_uri

    name = "adapt" + cluster_env
    private_sweeps(workdir, name, seeds=[0, 1])
    assert main(["launch", name, "cluster=slurm", "train.max_steps=6", "--until-decided", "--max-seeds", "2"]) == 0
    out = capsys.readouterr().out
    controller = out.split("controller job ", 1)[1].split(";", 1)[0]
    # the shell is free at once; the controller trains the first round through its own launch, then looks
    assert wait_jobs([controller], timeout=900)[controller] == "COMPLETED"
    client = mlflow_client(resolve_tracking_uri(""))
    looks = read_looks(client, client.get_experiment_by_name(name).experiment_id)
    assert [(look["round"], look["n"], look["added"]) for look in looks] == [(1, 2, [])]
    log = next((workdir / "runs" / name / "_submitit").glob(f"{controller}/{controller}_0_log.out")).read_text()
    assert "stopped after 1 looks: max seeds reached (2)" in log
    assert {r.data.tags.get("study.seed") for r in mlflow_runs(name)} == {"0", "1"}  # the looks run is not one


def test_missing_shards_are_tokenised_by_a_cpu_job_that_training_waits_for(workdir, cluster_env):
    from study.launch.submit import launch

    name = "prep" + cluster_env
    common = {**SMALL["common"], "data": {**SMALL["common"]["data"], "cache_dir": str(workdir / "cache")}}
    private_sweeps(workdir, name, common=common, variants={"conventional": {"model": "conventional"}})
    over = ["cluster=slurm", "cluster.prepare_cpus=2"]
    stages = launch(name, over, echo=lambda m: None)
    assert [s.name for s in stages] == ["prepare", "train"]
    (prepare_job,), (train_job,) = stages[0].job_ids, stages[1].job_ids
    assert stages[1].after == [prepare_job]
    wait_jobs([prepare_job, train_job])
    acct = subprocess.run(["sacct", "-n", "-P", "-X", "--format=JobID,State,Start,End,AllocCPUS,AllocTRES", "-j",
                           f"{prepare_job},{train_job}"], capture_output=True, text=True, check=True).stdout
    rows = {line.split("|")[0]: line.split("|") for line in acct.splitlines()}
    prep, trained = rows[prepare_job], rows[train_job]
    assert prep[1] == trained[1] == "COMPLETED", acct
    assert prep[3] <= trained[2], acct  # training started only once the shards were written
    assert prep[4] == "2" and "gpu" not in prep[5], acct
    [entry] = [p for p in (workdir / "cache" / "shards").iterdir() if p.is_dir()]
    assert (workdir / "runs" / name / stages[1].runs[0].key / "tokenizer.json").read_bytes() == \
        (entry / "tokenizer.json").read_bytes()
    assert [r.info.status for r in mlflow_runs(name)] == ["FINISHED"]
    assert launch(name, over, echo=lambda m: None) == []  # shards present, run finished: nothing to submit
