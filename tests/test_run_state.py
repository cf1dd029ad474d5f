"""One answer per run to "what does it still need, and does something already work on it": the run directory says
done (result.json, the evaluation records) and running (the lease), the scheduler says queued or stuck, MLflow only
mirrors. `study launch` (to_submit), `study status` and `--until-decided` read that one answer, so they agree; where
MLflow and the run directory disagree the run directory wins and the disagreement is named. Built from real run
directories, real training and a real SQLite MLflow store. SLURM's two answers here come from a stand-in `squeue`, so
all five states sit in one plan without a cluster; the same states from real jobs on the local SLURM (a held job
queued, a job stuck behind a cancelled one, status and relaunch reading them) are pinned in test_launch_slurm.py."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from slurm_helpers import SMALL, private_sweeps
from study.launch import run_state
from study.launch.run_state import EVALUATION, MIRROR, NOTHING, QUEUED, RUNNING, STUCK, TRAINING, state_of
from study.launch.scheduler import record
from study.launch.stages import Queue, to_submit
from study.launch.status import experiment_status
from study.launch.submit import write_specs
from study.plan.planner import plan_experiment
from study.train.lease import Lease
from study.train.loop import train

OVER = ["cluster=local", "train.max_steps=4", "train.ckpt_interval=2", "train.val_interval=2"]
EVAL = ["eval.after_train=true", "eval.limit=4", "eval.tasks=[arc_easy_local]"]
STUCK_WORDS = "stuck (a job it waits for failed or was cancelled, so it never starts; `study launch` resubmits it)"


@pytest.fixture
def five_runs(workdir, monkeypatch):
    """Seeds 0-4 of one variant: 0 trained, 1 stopped at step 2, 2 held by a lease, 3 queued on SLURM, 4 stuck there."""
    tree = private_sweeps(workdir, "states", seeds=[0, 1, 2, 3, 4], variants={"conventional": {"model": "conventional"}},
                          common={**SMALL["common"], "model": {**SMALL["common"]["model"], "max_seq_len": 128}})
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    plan = plan_experiment("states", OVER)
    write_specs(plan)
    done, stopped, leased, queued, stuck = plan.runs
    assert train(done).status == "FINISHED"
    assert train(plan_experiment("states", [*OVER, "faults.stop_at_step=2"]).runs[1]).status == "PREEMPTED"
    # SLURM's word on the two jobs the journal holds: one waits its turn, one waits for a job that will never succeed
    shim = workdir / "bin"
    shim.mkdir()
    (shim / "squeue").write_text("#!/bin/sh\necho '4242|PENDING|Priority'\necho '4243|PENDING|DependencyNeverSatisfied'\n")
    (shim / "sacct").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("squeue", "sacct"):
        (shim / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    record("runs", "states", [{"key": r.key, "job_id": j, "stage": "train", "scheduler": "slurm", "name": r.name,
                               "after": [], "host": socket.gethostname()} for r, j in ((queued, "4242"), (stuck, "4243"))])
    lease = Lease(leased.run_dir.path)  # `study train` by hand, say: no journal knows it
    assert lease.try_acquire()
    yield plan
    lease.release()


def answers(plan):
    queue = Queue(plan)
    states = {r.name: state_of(r, queue) for r in plan.runs}
    _, train_runs, _, _ = to_submit(plan, queue)
    rows = {r.name: r for r in experiment_status("states", OVER, plan)}
    return states, [r.name for r in train_runs], queue, rows


@pytest.mark.integration
def test_each_state_has_one_answer_that_launch_status_and_until_decided_share(five_runs):
    plan = five_runs
    states, submitted, queue, rows = answers(plan)
    holder = f"{socket.gethostname()} {os.getpid()}"
    assert {name: (s.needs, s.worker.what, s.mlflow, s.disagreement) for name, s in states.items()} == {
        "conventional-tiny-s0": (NOTHING, None, "FINISHED", ""),
        "conventional-tiny-s1": (TRAINING, None, "KILLED", ""),
        "conventional-tiny-s2": (TRAINING, RUNNING, "-", ""),
        "conventional-tiny-s3": (TRAINING, QUEUED, "-", ""),
        "conventional-tiny-s4": (TRAINING, STUCK, "-", ""),
    }
    assert states["conventional-tiny-s2"].worker.by == f"a live process ({holder}) holds its run directory's lease"
    # the launch submits what needs something and that nothing works on; a stuck job's run is submitted again
    assert submitted == ["conventional-tiny-s1", "conventional-tiny-s4"]
    assert {name: why for name, why in queue.elsewhere.values()} == {
        "conventional-tiny-s2": f"a live process ({holder}) holds its run directory's lease",
        "conventional-tiny-s3": "SLURM job 4242 is PENDING"}
    # status reads the same answer: its state column, and `--until-decided`'s test of a finished round
    assert {name: r.verdict for name, r in rows.items()} == {
        "conventional-tiny-s0": "finished",
        "conventional-tiny-s1": "not submitted",
        "conventional-tiny-s2": f"running (a live process ({holder}) holds its run directory's lease)",
        "conventional-tiny-s3": "queued",
        "conventional-tiny-s4": STUCK_WORDS,
    }
    assert {name: r.state for name, r in rows.items()} == states
    assert [name for name, r in rows.items() if r.state.done] == ["conventional-tiny-s0"]


@pytest.mark.integration
def test_a_trained_run_to_be_evaluated_needs_its_evaluation_of_record(five_runs):
    plan = plan_experiment("states", [*OVER, *EVAL])  # evaluation settings are outside the key: the same runs
    assert [r.key for r in plan.runs] == [r.key for r in five_runs.runs]
    states, submitted, _, rows = answers(plan)
    assert (states["conventional-tiny-s0"].needs, states["conventional-tiny-s0"].worker.what) == (EVALUATION, None)
    assert submitted == ["conventional-tiny-s0", "conventional-tiny-s1", "conventional-tiny-s4"]
    assert rows["conventional-tiny-s0"].verdict == "not evaluated (trained; `study launch` evaluates its final checkpoint)"
    assert not rows["conventional-tiny-s0"].state.done


@pytest.mark.integration
def test_where_mlflow_and_the_run_directory_disagree_the_run_directory_wins_and_says_so(five_runs, workdir):
    from study.track.query import open_store

    plan = five_runs
    done = plan.runs[0]
    aside = workdir / "result.json"
    shutil.move(done.run_dir.result, aside)  # MLflow holds it FINISHED, its run directory does not
    states, submitted, queue, rows = answers(plan)
    said = "MLflow says FINISHED, yet its run directory holds no result.json"
    assert (states[done.name].needs, states[done.name].disagreement) == (TRAINING, said)
    assert submitted == [done.name, "conventional-tiny-s1", "conventional-tiny-s4"]
    assert queue.disagree == {done.key: (done.name, f"{said}; the run directory wins: its job trains it")}
    assert rows[done.name].verdict == f"not submitted ({said}: the run directory wins)"

    shutil.move(aside, done.run_dir.result)  # its result back, MLflow's run closed otherwise
    uri = done.config.tracking.uri
    # the store the run tracks to, as every reader opens it (not a tracking URI other tests set process-wide)
    open_store(uri, required=True).set_terminated(run_state.Sources("runs", "states", uri).mlflow[done.key].info.run_id,
                                                  "KILLED")
    states, submitted, _, rows = answers(plan)
    said = "its run directory holds its result.json, yet MLflow says KILLED"
    assert (states[done.name].needs, states[done.name].disagreement) == (MIRROR, said)
    assert submitted == [done.name, "conventional-tiny-s1", "conventional-tiny-s4"]
    assert rows[done.name].verdict == f"MLflow behind (`study launch` brings MLflow the result; {said}: the run " \
                                      "directory wins)"
    # what its job does: training resumes at the final checkpoint, and MLflow holds the run FINISHED again
    assert train(done).status == "FINISHED"
    states, submitted, _, rows = answers(plan)
    assert (states[done.name].needs, states[done.name].mlflow, states[done.name].disagreement) == (NOTHING, "FINISHED",
                                                                                                    "")
    assert submitted == ["conventional-tiny-s1", "conventional-tiny-s4"] and rows[done.name].verdict == "finished"


def test_a_finished_run_whose_run_directory_was_removed_is_not_submitted_and_the_launch_names_its_repair(
        workdir, monkeypatch):
    """MLflow holds the run FINISHED and its run directory is gone: its job would refuse to reopen that result of
    record at every launch (study.train.tracking.finished_elsewhere), so no launch submits it; the launch and
    status name the one command that repairs it, and after that command's restart it is submitted."""
    from study import schema
    from study.launch.submit import launch
    from study.track.query import open_store
    from study.track.store import get_or_create_experiment
    from study.train.restart import restart_idle

    tree = private_sweeps(workdir, "states", seeds=[0, 1], variants={"conventional": {"model": "conventional"}})
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    plan = plan_experiment("states", OVER)
    gone, fresh = plan.runs
    uri = gone.config.tracking.uri
    client = open_store(uri, required=True)  # what a finished run leaves in MLflow; its run directory never existed
    run = client.create_run(get_or_create_experiment(client, uri, "states"), tags={schema.TAG_RUN_KEY: gone.key})
    client.set_terminated(run.info.run_id, "FINISHED")
    assert not gone.run_dir.path.exists()

    lines: list[str] = []
    stages = launch("states", OVER, dry_run=True, echo=lines.append)
    assert [r.key for s in stages for r in s.runs] == [fresh.key]
    fix = f"`study launch states {' '.join(OVER)} --restart {gone.key}`"
    assert [line for line in lines if gone.key in line] == [
        f"not submitted: {gone.name} ({gone.key}): MLflow holds it FINISHED, yet its run directory holds neither its "
        "result.json nor its final checkpoint, so its job would refuse to reopen that result of record at every "
        f"launch: {fix} trains it again from step 0 (that MLflow run is set aside)"]
    rows = {r.key: r for r in experiment_status("states", OVER, plan)}
    assert rows[gone.key].verdict.startswith("blocked (no job can train it, so `study launch` submits none: MLflow")
    assert fix in rows[gone.key].verdict and not rows[gone.key].state.done

    restart_idle(gone)  # what the named command does before it launches
    stages = launch("states", OVER, dry_run=True, echo=lines.append)
    assert [r.key for s in stages for r in s.runs] == [gone.key, fresh.key]
    assert client.get_run(run.info.run_id).info.lifecycle_stage == "deleted"  # set aside, restorable
