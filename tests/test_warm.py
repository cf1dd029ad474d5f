"""Warm starts of local jobs (`study.launch.warm`): a task forked from the launch's server runs as the same command
run cold would, in the client's directory, environment and streams, gets the client's signals and exits as it
would; without a server the client runs the command itself. The servers here preload only `json` (a launcher's
preloads torch and MLflow)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TRAINING_RUNS
from study.launch import warm
from study.launch.warm import WarmStarter

TASK = '''
import json, os, signal, sys, time
if sys.argv[1] == "report":
    print(json.dumps({"cwd": os.getcwd(), "env": os.environ.get("WARM_PROBE"), "argv": sys.argv[1:],
                      "pid": os.getpid(), "ppid": os.getppid(), "json": "json" in sys.modules,
                      "signals": [signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                                  signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
                                  signal.getsignal(signal.SIGTERM) == signal.SIG_DFL]}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "wait":  # exits 7 on TERM, after saying it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    open("started", "w").write(str(os.getpid()))
    time.sleep(60)
if sys.argv[1] == "hang":
    open("started", "w").write(str(os.getpid()))
    time.sleep(60)
'''


@pytest.fixture
def task_dir(tmp_path):
    (tmp_path / "warmtask.py").write_text(TASK)
    return tmp_path


def client(starter_or_python, cwd: Path, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    python = starter_or_python if isinstance(starter_or_python, str) else starter_or_python.python
    env = {**os.environ, **(env or {})}  # the PYTHONPATH the server has: another would make it refuse
    return subprocess.Popen([*python.split(), "-u", "-m", "warmtask", *args], cwd=cwd, env=env, text=True, **popen)


def wait_for(path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(path.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for this purpose (its parent, the server, reaps it on its next pass)
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_forked_task_runs_in_the_clients_directory_environment_and_streams_and_exits_with_its_code(task_dir):
    with WarmStarter(preload=("json",)) as starter:
        assert starter.python is not None
        proc = client(starter, task_dir, "report", "3", env={"WARM_PROBE": "mine"}, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=60)
        server = starter.pid
    assert proc.returncode == 3
    seen = json.loads(out)
    assert seen["cwd"] == str(task_dir) and seen["env"] == "mine" and seen["argv"] == ["report", "3"]
    assert seen["ppid"] == server and seen["pid"] != proc.pid  # forked by the server, not started by the client
    assert seen["signals"] == [True, True, True]  # as a fresh interpreter sets them
    assert seen["json"] is True and err == f"warm start: task {seen['pid']} forked by server {server}\nto stderr\n"


def test_without_a_server_the_client_runs_the_command_itself(task_dir, tmp_path):
    python = f"{sys.executable} -m study.launch.warm {tmp_path / 'no-such-socket'}"
    proc = client(python, task_dir, "report", "0", env={"WARM_PROBE": "cold"}, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    seen = json.loads(out)
    assert proc.returncode == 0 and seen["pid"] == proc.pid and seen["env"] == "cold"  # the client became the task
    assert seen["signals"] == [True, True, True]


def test_a_signal_to_the_client_reaches_the_task_and_a_killed_task_kills_its_client_the_same_way(task_dir):
    with WarmStarter(preload=()) as starter:
        proc = client(starter, task_dir, "wait")
        task = wait_for(task_dir / "started")
        assert task != proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 7  # the task's TERM handler ran
        (task_dir / "started").unlink()
        proc = client(starter, task_dir, "hang")
        task = wait_for(task_dir / "started")
        os.kill(task, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL


def test_a_killed_client_takes_its_task_with_it(task_dir):
    with WarmStarter(preload=()) as starter:
        proc = client(starter, task_dir, "hang")
        task = wait_for(task_dir / "started")
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while alive(task) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(task)


def test_a_closed_server_finishes_its_running_task_takes_no_new_one_and_exits(task_dir):
    starter = WarmStarter(preload=())
    python, server = starter.python, starter._proc
    running = client(starter, task_dir, "wait")
    task = wait_for(task_dir / "started")
    starter.close()
    time.sleep(0.5)
    assert server.poll() is None and alive(task)  # still serving its task
    later = client(python, task_dir, "report", "0", stdout=subprocess.PIPE)
    out, _ = later.communicate(timeout=60)
    assert later.returncode == 0 and json.loads(out)["pid"] == later.pid  # started cold
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=60) == 7
    assert server.wait(timeout=30) == 0


def _own_server(folder: Path) -> tuple[subprocess.Popen, Path]:
    """`python -m study.launch.warm serve FOLDER` started by a parent of its own, which exits when its stdin closes."""
    folder.mkdir(mode=0o700)
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-m', "
                               f"'study.launch.warm', 'serve', {str(folder)!r}, '']); sys.stdin.read()"],
                              stdin=subprocess.PIPE, text=True)
    sock = folder / "socket"
    wait = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < wait:
        time.sleep(0.02)
    return parent, sock


def test_a_server_named_in_the_environment_serves_every_launch_and_outlives_them(task_dir, tmp_path, monkeypatch):
    """`python -m study.launch.warm serve DIR` started on its own: `shared()` hands out its socket while it is there
    (no server of the process's own), closing that starter leaves it serving, and it exits when its parent does."""
    parent, sock = _own_server(tmp_path / "srv")
    try:
        monkeypatch.setattr(warm, "_SHARED", [])
        monkeypatch.setenv(warm.ENV, str(sock))
        outside = warm.shared()
        assert outside.python == f"{sys.executable} -m study.launch.warm {sock}" and outside.serving()
        assert not warm._SHARED
        outside.close()
        first, second = (client(warm.shared(), task_dir, "report", str(code), stdout=subprocess.PIPE)
                         for code in (0, 4))
        seen = [json.loads(p.communicate(timeout=60)[0]) for p in (first, second)]
        assert (first.returncode, second.returncode) == (0, 4)
        server = seen[0]["ppid"]
        assert seen[1]["ppid"] == server and server not in (os.getpid(), first.pid, second.pid, parent.pid)
    finally:
        parent.communicate("")  # the parent exits: the server stops taking jobs and removes its socket
    wait = time.monotonic() + 30
    while sock.exists() and time.monotonic() < wait:
        time.sleep(0.02)
    assert not sock.exists()
    fallback = warm.shared()  # the named server is gone: this process starts its own
    assert fallback.serving() and fallback.python != outside.python and warm._SHARED == [fallback]
    fallback.close()


def test_a_named_server_that_died_or_forks_for_another_pythonpath_is_passed_over(tmp_path, monkeypatch):
    """A socket file its killed server left behind, or a server of another PYTHONPATH (it would refuse every job, and
    each would start cold): `shared()` starts this process's own server instead."""
    parent, sock = _own_server(tmp_path / "srv")
    try:
        monkeypatch.setattr(warm, "_SHARED", [])
        monkeypatch.setenv(warm.ENV, str(sock))
        mine = os.environ.get("PYTHONPATH")  # the server's too
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "elsewhere"))
        other = warm.shared()
        assert other.python != f"{sys.executable} -m study.launch.warm {sock}" and warm._SHARED == [other]
        other.close()
        if mine is None:
            monkeypatch.delenv("PYTHONPATH")
        else:
            monkeypatch.setenv("PYTHONPATH", mine)
        monkeypatch.setattr(warm, "_SHARED", [])
        assert warm.shared().python == f"{sys.executable} -m study.launch.warm {sock}"  # the same server, matched
        server = int(subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout)
        os.kill(server, signal.SIGKILL)
        wait = time.monotonic() + 30
        while alive(server) and time.monotonic() < wait:
            time.sleep(0.02)
        assert sock.exists()  # left behind
        monkeypatch.setattr(warm, "_SHARED", [])
        own = warm.shared()
        assert own.serving() and own.python != f"{sys.executable} -m study.launch.warm {sock}"
        own.close()
    finally:
        parent.communicate("")


def test_a_client_of_another_pythonpath_or_interpreter_is_refused_and_runs_cold(task_dir, tmp_path):
    """A server holds the imports of its own interpreter and PYTHONPATH: a client of another would run code the
    launcher did not mean, so it starts its command itself (and the server says why on its standard error)."""
    with WarmStarter(preload=()) as starter:
        proc = client(starter, task_dir, "report", "0", env={"PYTHONPATH": str(tmp_path / "elsewhere")},
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=60)
        seen = json.loads(out)
        assert proc.returncode == 0 and seen["pid"] == proc.pid and "warm start" not in err
        # the same request from another interpreter, sent by hand: refused, the connection closed without a task
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(starter.python.split()[-1])
        with open(os.devnull) as null:
            warm._send(conn, {"argv": ["-m", "warmtask", "report", "0"], "cwd": str(task_dir), "env": dict(os.environ),
                              "python": str(tmp_path / "other" / "python")}, fds=[null.fileno()] * 3)
        with pytest.raises(ConnectionError):
            warm._receive(conn)
        conn.close()


def test_the_servers_socket_is_reachable_by_its_user_alone(tmp_path):
    with WarmStarter(preload=()) as starter:
        folder = Path(starter.python.split()[-1]).parent
        assert folder.stat().st_mode & 0o777 == 0o700


@pytest.mark.integration
def test_a_local_launch_forks_its_runs_from_its_server_and_they_train_what_cold_starts_train(workdir, monkeypatch):
    """The same run launched warm (the default) and cold (`cluster.warm_start=false`) in two directories: the same
    final loss and curve; the warm launch's server log names the task it forked in the run's job folder."""
    from mlflow import MlflowClient

    from slurm_helpers import private_sweeps
    from study.launch.submit import launch
    from study.plan.planner import plan_experiment

    monkeypatch.setenv("STUDY_SWEEPS", str(private_sweeps(workdir, "warm", variants={"h": {"model": "hourglass"}},
                                                          baseline="h")))
    curves = {}
    for mode in ("true", "false"):
        where = workdir / mode
        where.mkdir()
        shutil.copyfile(workdir / "mlflow.db", where / "mlflow.db")
        monkeypatch.chdir(where)
        launch("warm", ["cluster=local", f"cluster.warm_start={mode}"], echo=lambda line: None)
        (run,) = plan_experiment("warm").runs
        result = json.loads(run.run_dir.result.read_text())
        client = MlflowClient(f"sqlite:///{where}/mlflow.db")
        (mlrun,) = client.search_runs([client.get_experiment_by_name("warm").experiment_id], TRAINING_RUNS)
        history = [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "train/loss")]
        curves[mode] = (result["val_loss"], history)
        # every job of the launch (its data preparation too, when the cache lacks the shards) says how it started
        logs = [p.read_text() for p in (where / "runs" / "warm" / "_submitit").glob("*/*_log.err")]
        assert logs and all(("warm start: task " in log) == (mode == "true") for log in logs)
    assert curves["true"] == curves["false"] and len(curves["true"][1]) == 16
