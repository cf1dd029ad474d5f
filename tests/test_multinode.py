"""Runs that span nodes, on a real two-node SLURM built on this machine (`slurm/local/up --nodes 2`: each slurmd in its
own network and UTS namespace, host names node1 and node2, on a bridge that exists only inside the namespaces the
script made): the rendezvous and HSDP across hosts, MLflow naming both hosts, checkpoints that resume on another
layout with the loss of an uninterrupted run, and `slurm/local/down` leaving nothing behind.

Jobs log to an SQLite MLflow store on the shared file system: the test's MLflow server listens on the machine's
loopback, which the nodes' namespaces do not share (on a real cluster the server's address is reachable from every
node)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY, new_store

UP, DOWN = ROOT / "slurm" / "local" / "up", ROOT / "slurm" / "local" / "down"


def _can_build_nodes() -> str:
    if os.geteuid() != 0:
        return "needs root: network namespaces"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/usr/sbin/slurmd").exists() and not os.environ.get("SLURM_CONF"):
        return "SLURM is not installed: slurm/local/up installs it"
    return ""


pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("multinode"),
              pytest.mark.skipif(bool(_can_build_nodes()), reason=_can_build_nodes() or "-")]


def _clean_env() -> dict[str, str]:
    """The caller's environment without any SLURM job's variables or cluster: the new cluster's own are added."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def new_base(tag: str) -> Path:
    """An empty base folder munged (user munge) can reach: pytest's own temporary folders are root's alone."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix=f"study-slurm-{tag}-", dir="/var/tmp"))
    base.chmod(0o755)
    return base


def remove_base(base: Path) -> None:
    shutil.rmtree(base, ignore_errors=True)
    Path(f"{base}.lock").unlink(missing_ok=True)  # up's lock file, beside the base


def start_cluster(base: Path, netns: str, nodes: int = 2) -> dict[str, str]:
    """Start a cluster of `nodes` under `base`; the environment its clients and jobs need (SLURM_CONF, PATH)."""
    env = {**_clean_env(), "STUDY_SLURM_BASE": str(base), "STUDY_SLURM_NETNS": netns}
    done = subprocess.run([str(UP), "--nodes", str(nodes)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():  # export SLURM_CONF=...; export PATH="<base>/bin:$PATH"
        name, value = line.removeprefix("export ").split("=", 1)
        env[name] = value.strip('"').replace("$PATH", os.environ["PATH"])
    return env


def stop_cluster(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(DOWN)], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def two_nodes():
    base = new_base("2n")
    env = start_cluster(base, f"stm{os.getpid()}")
    yield env
    stop_cluster(env)
    remove_base(base)


def sinfo_nodes(env) -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True, timeout=30)
    return sorted(out.stdout.split("\n")[:-1])


def run_job(env, workdir: Path, nodes: int, tasks_per_node: int, argv: list[str], timeout: float = 600) -> str:
    """sbatch --wait one job of `nodes` x `tasks_per_node` ranks running `argv` (shell words) under srun; its
    output."""
    out = workdir / f"job-{time.monotonic_ns()}.out"
    done = subprocess.run(
        ["sbatch", "--wait", "--quiet", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
         f"--chdir={workdir}", f"--output={out}", "--export=ALL,SUBMITIT_EXECUTOR=slurm",
         "--wrap", "srun " + " ".join(argv)],
        env=env, capture_output=True, text=True, timeout=timeout)
    text = out.read_text() if out.exists() else ""
    assert done.returncode in (0, 75) or "PREEMPTED" in text, f"job failed ({done.returncode}): {done.stderr}{text[-3000:]}"
    return text


TRAIN = [*TINY, "train.max_steps=12", "train.ckpt_interval=3", "train.val_interval=6", "train.global_batch=8",
         "train.log_interval=1"]


def spec_for(workdir: Path, runs: str, store: str, extra: list[str] = ()):
    from study.config.spec import write_spec
    from study.plan.planner import plan_adhoc

    db = workdir / store
    uri = f"sqlite:///{db}" if db.exists() else new_store(db)
    spec = plan_adhoc([*TRAIN, "experiment=multinode", f"paths.runs={workdir / runs}", f"tracking.uri={uri}", *extra])
    return spec, write_spec(spec)


def losses(workdir: Path, store: str, key: str) -> tuple[dict[int, float], dict[int, float], dict]:
    """(train/loss by step, val/loss by step, tags) of the run with this key, each step's points counted once."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / store}")
    exp = client.get_experiment_by_name("multinode")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`study.run_key` = '{key}'")
    out = []
    for metric in ("train/loss", "val/loss"):
        history = client.get_metric_history(run.info.run_id, metric)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{metric} points duplicated: {sorted(steps)}"
        out.append({m.step: m.value for m in history})
    return out[0], out[1], {**run.data.tags, "status": run.info.status}


def same_curve(train: dict[int, float], val: dict[int, float], uninterrupted) -> None:
    """Every step's point once, each within 1e-5 of the uninterrupted run's (fp32 round-off of another reduction
    order across ranks)."""
    want_train, want_val, _ = uninterrupted
    assert sorted(train) == list(range(1, 13)) and sorted(val) == sorted(want_val)
    for step in train:
        assert train[step] == pytest.approx(want_train[step], abs=1e-5), step
    for step in val:
        assert val[step] == pytest.approx(want_val[step], abs=1e-5), step


def python_train(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "study.cli", "train", "--spec", str(spec_path)]


@pytest.mark.integration
def test_two_nodes_answer_each_in_its_own_namespace_with_its_own_host_name(two_nodes, tmp_path):
    assert sinfo_nodes(two_nodes) == ["node1 idle", "node2 idle"]
    text = run_job(two_nodes, tmp_path, 2, 1, ["bash", "-c", "'echo $(hostname) $(ip -4 -o addr show eth0)'"])
    hosts = sorted(line.split()[0] for line in text.splitlines() if line.startswith("node"))
    assert hosts == ["node1", "node2"]
    assert "10.251.0.11/24" in text and "10.251.0.12/24" in text


@pytest.fixture(scope="module")
def uninterrupted(data_cache, tmp_path_factory):
    """The run trained without interruption on 1 node x 1 rank, here: the curve every layout's must match."""
    from study.train.loop import train

    workdir = tmp_path_factory.mktemp("straight")
    spec, _ = spec_for(workdir, "runs", "straight.db")
    assert train(spec).step == 12
    return losses(workdir, "straight.db", spec.key)


@pytest.mark.integration
def test_a_run_across_two_nodes_trains_with_hsdp_and_names_both_hosts(two_nodes, uninterrupted, workdir):
    spec, path = spec_for(workdir, "runs", "mn.db")
    text = run_job(two_nodes, workdir, 2, 1, python_train(path))
    assert f"{spec.name} rank 0 of 2 on host node1" in text and f"{spec.name} rank 1 of 2 on host node2" in text
    train, val, tags = losses(workdir, "mn.db", spec.key)
    assert tags["status"] == "FINISHED"
    assert tags["study.hosts"] == "node1,node2" and tags["study.world_size"] == "2"
    assert tags["study.layout"] == "from step 0: 2 nodes x 1 rank, hybrid"
    same_curve(train, val, uninterrupted)


LAYOUTS = ((2, 1), (1, 2), (1, 1), (2, 1))
"""nodes x ranks of each stretch of 3 steps: 2x1 -> 1x2 -> 1x1 -> back to 2x1."""


def layout_words(nodes: int, per: int) -> str:
    how = "unsharded" if nodes * per == 1 else ("hybrid" if nodes > 1 else "full")
    return f"{nodes} node{'s' * (nodes > 1)} x {per} rank{'s' * (per > 1)}, {how}"


@pytest.mark.integration
def test_a_run_stopped_on_one_layout_resumes_on_another_with_the_uninterrupted_loss(two_nodes, uninterrupted,
                                                                                    workdir):
    """DCP checkpoints reshard on load, with no conversion step: a run trained 3 steps at a time on 2 nodes x 1 rank,
    1 node x 2 ranks, 1 x 1 and 2 x 1 again has the uninterrupted run's loss at every step, every point once."""
    for i, (nodes, per) in enumerate(LAYOUTS):
        last = i == len(LAYOUTS) - 1
        spec, path = spec_for(workdir, "runs", "mn.db", [] if last else [f"faults.stop_at_step={3 * (i + 1)}"])
        if nodes * per == 1:
            done = subprocess.run(python_train(path), cwd=workdir, capture_output=True, text=True, timeout=600)
            assert done.returncode in (0, 75), done.stderr[-3000:]
        else:
            run_job(two_nodes, workdir, nodes, per, python_train(path))
        assert spec.run_dir.result.exists() == last
    assert json.loads(spec.run_dir.result.read_text())["step"] == 12
    train, val, tags = losses(workdir, "mn.db", spec.key)
    same_curve(train, val, uninterrupted)
    assert tags["study.layout"] == "; ".join(f"from step {3 * i}: {layout_words(*shape)}"
                                             for i, shape in enumerate(LAYOUTS))
    assert tags["study.hosts"].split(",")[:2] == ["node1", "node2"]


@pytest.mark.integration
def test_down_leaves_no_namespace_link_or_daemon_and_is_safe_twice(tmp_path):
    netns, base = f"std{os.getpid()}", new_base("down")
    env = start_cluster(base, netns)
    pids = {f.name: int(f.read_text()) for f in (base / "run").glob("*.pid")}
    assert {"slurmd.node1.pid", "slurmd.node2.pid", "slurmctld.pid"} <= set(pids)
    # a job still running on both nodes goes with its nodes
    subprocess.run(["sbatch", "--nodes=2", f"--chdir={tmp_path}", "--wrap", "srun sleep 300"], env=env, check=True,
                   capture_output=True, timeout=60)
    time.sleep(3)
    assert stop_cluster(env).returncode == 0
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netns not in names
    assert not [p for p in Path("/etc/netns").glob(f"{netns}-*")] if Path("/etc/netns").exists() else True
    assert not [pid for pid in pids.values() if Path(f"/proc/{pid}").exists()]
    assert "10.251.0." not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    again = stop_cluster(env)
    assert again.returncode == 0 and again.stderr == ""
    remove_base(base)


def launch_across_two_nodes(two_nodes, workdir: Path, monkeypatch, name: str, checkpoint_step: int):
    """`study launch` of one tiny run with `cluster.nodes=2` (16 steps, a checkpoint every 4, slowed so that faults
    land mid-run), once its checkpoint at `checkpoint_step` exists: (its job ids, its spec, its job's id)."""
    from slurm_helpers import SMALL, private_sweeps
    from study.launch.scheduler import journal
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    for variable, value in two_nodes.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_store(workdir / "mn.db"))
    common = {**SMALL["common"], "train": {**SMALL["common"]["train"], "log_interval": 1},
              "faults": {"sleep_per_step": 0.5}}
    sweeps = private_sweeps(workdir, name, variants={"conventional": {"model": "conventional"}}, common=common)
    monkeypatch.setenv("STUDY_SWEEPS", str(sweeps))
    over = ["cluster=slurm", "cluster.nodes=2", "train.global_batch=8"]
    stages = launch(name, over, echo=lambda m: None)
    (run,) = plan_experiment(name, over).runs
    ckpts = run.run_dir.path / "checkpoints"
    deadline = time.time() + 300
    while not any(p.name.endswith(f"{checkpoint_step:02d}") for p in ckpts.glob("step_*")):
        assert time.time() < deadline, f"no checkpoint at step {checkpoint_step}"
        time.sleep(0.3)
    return [j for s in stages for j in s.job_ids], run, journal(run.config.paths.runs, name)[run.key]["job_id"]


def resumed_once_on_both_hosts(workdir: Path, name: str, run) -> int:
    """Checks that the run finished on node1 and node2 with every train/loss point once over two starts; the step
    the second start resumed from."""
    from mlflow import MlflowClient

    assert json.loads(run.run_dir.result.read_text())["step"] == 16
    client = MlflowClient(f"sqlite:///{workdir / 'mn.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name(name).experiment_id],
                                  filter_string=f"tags.`study.run_key` = '{run.key}'")
    tags = found.data.tags
    assert found.info.status == "FINISHED" and tags["study.hosts"] == "node1,node2"
    segments = tags["study.layout"].split("; ")
    assert len(segments) == 2 and all(s.endswith(": 2 nodes x 1 rank, hybrid") for s in segments)
    steps = [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")]
    assert sorted(steps) == sorted(set(steps)) == list(range(1, 17))  # every point once
    return int(segments[1].removeprefix("from step ").split(":")[0])


@pytest.mark.integration
def test_a_launch_across_two_nodes_is_preempted_on_both_and_resumes_with_every_point_once(two_nodes, workdir,
                                                                                          monkeypatch):
    """`cluster.nodes=2` through `study launch`: one job of 2 x 1 ranks per run; USR2 reaches both ranks, the run
    checkpoints once, requeues once and finishes on both hosts again."""
    from slurm_helpers import wait_jobs

    ids, run, job = launch_across_two_nodes(two_nodes, workdir, monkeypatch, "multinode", 4)
    subprocess.run(["scancel", "--signal=USR2", job], check=True, env=two_nodes)
    wait_jobs(ids, timeout=600)
    time.sleep(3)
    wait_jobs(ids, timeout=600)  # a requeued job is pending again before it restarts
    # from the checkpoint the signal made at the step it arrived (every rank wrote its shard of it)
    assert 4 <= resumed_once_on_both_hosts(workdir, "multinode", run) < 16


NODE = ROOT / "slurm" / "local" / "node"


@pytest.mark.integration
def test_a_node_lost_mid_run_ends_the_job_which_requeues_and_resumes_with_nothing_lost(two_nodes, workdir,
                                                                                       monkeypatch):
    """node2's slurmd and every process in its namespace killed mid-run: rank 0 does not hang (the lost peer ends its
    collective), SLURM marks the node down and requeues the job; once node2 is back the run resumes from its last
    complete checkpoint on both hosts, every metric point once."""
    from slurm_helpers import wait_jobs

    ids, run, job = launch_across_two_nodes(two_nodes, workdir, monkeypatch, "nodeloss", 8)
    env = {**two_nodes, "STUDY_SLURM_BASE": two_nodes["SLURM_CONF"].rsplit("/", 1)[0]}
    try:
        subprocess.run([str(NODE), "kill", "2"], env=env, check=True, timeout=30)
        deadline = time.time() + 120
        while "PENDING" not in (state := subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env,
                                                         capture_output=True, text=True).stdout):
            assert time.time() < deadline, f"job {job} not requeued after its node was lost: {state!r}"
            time.sleep(1)
    finally:
        subprocess.run([str(NODE), "start", "2"], env=env, check=True, timeout=60)
    wait_jobs(ids, timeout=600)
    assert 8 <= resumed_once_on_both_hosts(workdir, "nodeloss", run) < 16


@pytest.mark.integration
def test_calibrate_measures_a_two_node_shape_like_any_other(two_nodes, workdir, monkeypatch, capsys):
    """`study calibrate` with `cluster.nodes=2`: one calibration job across both hosts, its figure per device (the
    tokens/s of 2 ranks over 2), which `study plan` of that layout then reads."""
    from mlflow import MlflowClient

    from slurm_helpers import private_sweeps
    from study.cli import main
    from study.plan.throughput import CALIBRATION_EXPERIMENT, PER_DEVICE, TOKENS_PER_S

    for variable, value in two_nodes.items():
        monkeypatch.setenv(variable, value)
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("STUDY_SWEEPS", str(private_sweeps(workdir, "calib2",
                                                          variants={"conventional": {"model": "conventional"}})))
    over = ["cluster=slurm", "cluster.nodes=2", "train.global_batch=8"]
    assert main(["calibrate", "calib2", *over, "--steps", "8"]) == 0
    capsys.readouterr()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(CALIBRATION_EXPERIMENT).experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["study.hosts"] == "node1,node2"
    assert run.data.tags["study.world_size"] == "2"
    assert run.data.metrics[PER_DEVICE] == pytest.approx(run.data.metrics[TOKENS_PER_S] / 2, rel=1e-12)
    assert main(["plan", "calib2", *over, "--json"]) == 0
    (planned,) = json.loads(capsys.readouterr().out)["runs"]
    assert planned["gpu_hours_from"] == "measured on slurm" and planned["nodes"] == 2 and planned["devices"] == 2
    assert planned["tokens_per_s"] == pytest.approx(run.data.metrics[TOKENS_PER_S], rel=1e-12)
