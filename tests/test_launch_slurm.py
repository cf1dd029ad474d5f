"""Sweeps on the real local SLURM cluster: arrays, idempotent relaunch, resume of a failed run, preemption,
requeue, and a 2-task FSDP job. Needs `slurm/local/up` (scripts/test starts it)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from conftest import TRAINING_RUNS, new_store
from slurm_helpers import SMALL, private_sweeps, sacct_state, slurm_available, wait_jobs

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
                                   if r.data.tags.get("study.role") != "report"]


def job_ids(stages):
    return [j for s in stages for j in s.job_ids]


@pytest.mark.integration
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
    victim = next(r for r in plan.runs if r.config.variant == "hourglass")
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

    from study.track.store import resolve_tracking_uri

    resumed = next(r for r in runs if r.data.tags["study.run_key"] == victim.key)
    assert int(resumed.data.tags["study.restarts"]) >= 1
    # the store the jobs logged to, named: another test's mlflow.set_tracking_uri would outrank the environment
    client = MlflowClient(resolve_tracking_uri(""))
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 17))  # resumed, nothing lost, nothing twice
    assert launch(name, over, echo=lambda m: None) == []  # everything finished: nothing to submit


@pytest.mark.integration
def test_usr2_preemption_and_scontrol_requeue_end_with_the_uninterrupted_val_loss(workdir, cluster_env):
    import json

    from study.launch.scheduler import journal
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment
    from study.train.loop import train

    name = "small" + cluster_env
    common = {**SMALL["common"], "faults": {"sleep_per_step": 0.4}}
    private_sweeps(workdir, name, common=common, seeds=[0, 1], variants={"conventional": {"model": "conventional"}})
    over = ["cluster=slurm"]
    stages = launch(name, over, echo=lambda m: None)
    plan = plan_experiment(name, over)
    jobs = journal(plan.runs[0].config.paths.runs, name)
    a, b = [r for r in plan.runs if r.config.variant == "conventional"]
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

    # the same two runs, uninterrupted, trained here in a separate runs folder and store (launch-only settings: same
    # keys)
    clean = plan_experiment(name, over + ["paths.runs=clean", f"tracking.uri={new_store(workdir / 'clean.db')}",
                                          "faults.sleep_per_step=0"]).runs
    assert [r.key for r in clean] == [r.key for r in plan.runs]
    for run in (a, b):
        got = json.loads((workdir / "runs" / name / run.key / "result.json").read_text())
        want = train(next(r for r in clean if r.key == run.key))
        assert got["val_loss"] == want.val_loss and got["step"] == want.step == 16


@pytest.mark.integration
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


@pytest.mark.integration
def test_hydra_multirun_on_slurm_trains_every_grid_point(workdir, cluster_env):
    import sys

    from conftest import TINY

    cmd = [sys.executable, "-m", "study.train", "-m", "hydra/launcher=study_slurm", "seed=0,1",
           *[o for o in TINY if not o.startswith("scale=")], "scale=tiny", "train.max_steps=6",
           f"hydra.job.name=hygrid{cluster_env}"]
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "STUDY_SWEEPS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    runs = mlflow_runs(f"hygrid{cluster_env}")
    assert sorted(r.info.run_name for r in runs) == ["conventional-tiny-s0", "conventional-tiny-s1"]
    assert all(r.info.status == "FINISHED" and r.data.tags.get("study.slurm_job_id") for r in runs)


@pytest.mark.integration
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
    clean = train(plan_experiment(name, over + ["paths.runs=clean", f"tracking.uri={new_store(workdir / 'c.db')}",
                                                "faults.sleep_per_step=0"]).runs[0])
    got = json.loads((workdir / "runs" / name / planned.key / "result.json").read_text())
    assert got["val_loss"] == clean.val_loss


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.fixture
def held_jobs(workdir, monkeypatch):
    """Every job the test submits is held (`sbatch --hold`: SLURM 22.05's sbatch reads no SBATCH_HOLD), so nothing
    trains, the point being the queue; the job ids the test adds to the list are cancelled at the end."""
    import shutil

    shim = workdir / "held-bin"
    shim.mkdir()
    (shim / "sbatch").write_text(f'#!/bin/sh\nexec {shutil.which("sbatch")} --hold "$@"\n')
    (shim / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30)


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what} within {timeout} s"
        time.sleep(0.5)


def test_a_job_whose_prepare_job_was_cancelled_is_stuck_and_a_relaunch_replaces_it(workdir, cluster_env, held_jobs):
    from study.launch.scheduler import STUCK, slurm_states
    from study.launch.status import experiment_status
    from study.launch.submit import launch

    name = "stuck" + cluster_env
    common = {**SMALL["common"], "data": {**SMALL["common"]["data"], "cache_dir": str(workdir / "cache")}}
    private_sweeps(workdir, name, common=common, variants={"conventional": {"model": "conventional"}})
    over = ["cluster=slurm"]
    first = launch(name, over, echo=lambda m: None)
    held_jobs += job_ids(first)
    (prepare,), (train,) = first[0].job_ids, first[1].job_ids
    (run,) = first[1].runs
    subprocess.run(["scancel", prepare], check=True)
    subprocess.run(["scontrol", "release", train], check=True)  # free to start, but what it waits for is gone
    _until(lambda: slurm_states([train])[train] == STUCK, 60, "SLURM finds the dependency never satisfied")

    (row,) = experiment_status(name, over)
    assert (row.job_id, row.job_state, row.verdict) == (train, STUCK, "stuck (a job it waits for failed or was "
                                                        "cancelled, so it never starts; `study launch` resubmits it)")

    said: list[str] = []
    again = launch(name, over, echo=said.append)
    held_jobs += job_ids(again)
    assert said[0] == (f"cancelled 1 job that could never start (a job each waits for failed or was cancelled): "
                       f"{train} {run.name} ({run.key}); what they were to do is submitted again")
    assert sacct_state(train, "CANCELLED") == "CANCELLED"
    assert [s.name for s in again] == ["prepare", "train"] and again[1].after == again[0].job_ids
    assert again[1].job_ids != [train] and [r.key for r in again[1].runs] == [run.key]


def test_new_runs_cancels_the_queued_jobs_of_runs_an_edited_experiment_no_longer_has(workdir, cluster_env,
                                                                                        held_jobs):
    from study.launch.submit import launch

    name = "edited" + cluster_env
    variants = {"conventional": {"model": "conventional"}}
    private_sweeps(workdir, name, variants=variants, seeds=[0])
    over = ["cluster=slurm"]
    first = launch(name, over, echo=lambda m: None)
    held_jobs += job_ids(first)
    (old,), (old_run,) = first[-1].job_ids, first[-1].runs

    private_sweeps(workdir, name, variants=variants, seeds=[1])  # the edit: seed 0 becomes seed 1
    said: list[str] = []
    again = launch(name, over, echo=said.append, new=True)
    held_jobs += job_ids(again)
    assert said[0] == (f"cancelled 1 queued job of runs no longer planned (the experiment file or the overrides "
                       f"changed): {old} {old_run.name} ({old_run.key})")
    assert sacct_state(old, "CANCELLED") == "CANCELLED"
    (new,), (new_run,) = again[-1].job_ids, again[-1].runs
    assert new != old and new_run.name == old_run.name.replace("-s0", "-s1")


def test_a_local_launch_skips_the_runs_queued_on_slurm_saying_so(workdir, cluster_env, held_jobs):
    from study.launch.scheduler import journal
    from study.launch.submit import launch

    name = "queued" + cluster_env
    private_sweeps(workdir, name)
    queued = launch(name, ["cluster=slurm"], echo=lambda m: None)
    held_jobs += job_ids(queued)
    train = queued[-1]
    said: list[str] = []
    assert launch(name, ["cluster=local"], echo=said.append) == []
    jobs = journal(workdir / "runs", name)
    assert said == [f"skipped {r.name} ({r.key}): SLURM job {jobs[r.key]['job_id']} is PENDING; it is not submitted "
                    "twice" for r in train.runs] + [f"{name}: nothing to submit, every planned run is finished or in "
                                                    "the queue"]


@pytest.mark.integration
def test_a_slurm_launch_skips_a_run_a_live_local_process_trains_saying_so(workdir, cluster_env, held_jobs):
    import signal
    import socket
    import sys

    from study.launch.scheduler import journal
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment
    from study.train.lease import Lease, held_by

    name = "shared" + cluster_env
    # long enough (400 steps of 0.5 s) that the run is still training when the launcher is stopped
    common = {**SMALL["common"], "train": {**SMALL["common"]["train"], "max_steps": 400},
              "faults": {"sleep_per_step": 0.5}}
    private_sweeps(workdir, name, variants={"conventional": {"model": "conventional"}}, common=common)
    (run,) = plan_experiment(name, ["cluster=local"]).runs
    log = (workdir / "local.log").open("w")
    local = subprocess.Popen([sys.executable, "-m", "study.cli", "launch", name, "cluster=local"], cwd=workdir,
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        # past its first step, so its signal handlers are in place when the launcher is stopped below
        _until(lambda: run.run_dir.progress.is_file(), 300, "the local launch starts training")
        said: list[str] = []
        assert launch(name, ["cluster=slurm"], echo=said.append) == []
        pid = journal(workdir / "runs", name)[run.key]["job_id"]
        assert said == [f"skipped {run.name} ({run.key}): local process {pid} on {socket.gethostname()} runs it; "
                        "it is not submitted twice",
                        f"{name}: nothing to submit, every planned run is finished or in the queue"]
    finally:
        local.send_signal(signal.SIGTERM)  # it checkpoints its run and stops
        local.wait(timeout=300)
    assert local.returncode == 128 + signal.SIGTERM, (workdir / "local.log").read_text()[-2000:]
    _until(lambda: held_by(run.run_dir.path) is None, 60, "the stopped run's lease is released")

    lease = Lease(run.run_dir.path)  # `study train` by hand, say: no journal knows it
    assert lease.try_acquire()
    try:
        said = []
        assert launch(name, ["cluster=slurm"], echo=said.append) == []
    finally:
        lease.release()
    assert said == [f"skipped {run.name} ({run.key}): a live process ({socket.gethostname()} {os.getpid()}) holds its "
                    "run directory's lease; it is not submitted twice",
                    f"{name}: nothing to submit, every planned run is finished or in the queue"]


@pytest.mark.integration
def test_a_branch_waits_held_and_its_trunk_releases_it_while_training_on(workdir, cluster_env):
    """Branches are submitted held (SLURM's JobHeldUser) and start as soon as their trunk writes their start
    checkpoint: the first branch starts before its trunk ends, and every run finishes once."""
    import json

    from datetime import datetime

    from study.config.run import Role
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment
    from study.schema import submitit_dir
    from study.train.checkpoint import at_step

    name = "branched" + cluster_env
    common = {**SMALL["common"], "train": {**SMALL["common"]["train"], "lr_schedule": "wsd", "ckpt_interval": 100},
              "faults": {"sleep_per_step": 1.0}}
    private_sweeps(workdir, name, common=common, variants={"conventional": {"model": "conventional"}},
                   branches={"at": [0.5, 1.0], "decay": 0.25})
    over = ["cluster=slurm"]
    stages = launch(name, over, echo=lambda m: None)
    branch_stage = next(s for s in stages if s.name == "branch")
    assert branch_stage.held and len(branch_stage.runs) == 2
    reasons = subprocess.run(["squeue", "-h", "-o", "%r", "-j", ",".join(branch_stage.job_ids)],
                             capture_output=True, text=True).stdout.split()
    assert reasons and set(reasons) <= {"JobHeldUser", "Dependency"}  # held, or still behind the data preparation
    from study.launch.status import experiment_status

    said = {r.key: r.verdict for r in experiment_status(name, over)}
    assert all(said[r.key].startswith("queued (held until trunk ") for r in branch_stage.runs)
    wait_jobs(job_ids(stages), timeout=900)
    plan = plan_experiment(name, over)
    trunk = next(r for r in plan.runs if r.role == Role.trunk)
    first = next(r for r in plan.runs if r.role == Role.branch and r.points[0].at == 0.5)
    for r in plan.runs:
        result = json.loads((workdir / "runs" / name / r.key / "result.json").read_text())
        assert result["step"] == (12 if r is trunk else r.points[0].length)

    def times(job):
        out = subprocess.run(["sacct", "-n", "-P", "-X", "--format=Start,End", "-j", job], capture_output=True,
                             text=True).stdout.split()[0]
        return out.split("|")

    jobs = dict(zip([r.key for r in stages[[s.name for s in stages].index("train")].runs],
                    stages[[s.name for s in stages].index("train")].job_ids))
    branch_jobs = dict(zip([r.key for r in branch_stage.runs], branch_stage.job_ids))
    # the trunk's own job released the branch from step 6 when it wrote that checkpoint, while training on to step
    # 12 (when the branch then starts depends on free slots: other tests share this cluster)
    trunk_job = jobs[trunk.key]
    trunk_log = submitit_dir(workdir / "runs", name) / trunk_job / f"{trunk_job}_0_log.err"
    assert f"released branch jobs {branch_jobs[first.key]} at step 6" in trunk_log.read_text()
    # held until then: the branch never started before its start checkpoint existed (ISO times compare as strings)
    written = datetime.fromtimestamp(at_step(workdir / "runs" / name / trunk.key, 6).stat().st_mtime)
    assert times(branch_jobs[first.key])[0] >= written.strftime("%Y-%m-%dT%H:%M:%S")
    assert sorted(r.data.tags["study.run_key"] for r in mlflow_runs(name)) == sorted(r.key for r in plan.runs)
