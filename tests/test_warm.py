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
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import TRAINING_RUNS
from study.launch import warm
from study.launch.warm import WarmStarter

TASK = '''
import json, os, signal, sys, time
if sys.argv[1] == "report":
    proc_environ = open("/proc/self/environ", "rb").read().decode(errors="replace").split("\\0")
    print(json.dumps({"cwd": os.getcwd(), "env": os.environ.get("WARM_PROBE"), "argv": sys.argv[1:],
                      "token": os.environ.get("WARM_PROBE_TOKEN"), "proc_environ": proc_environ,
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
if sys.argv[1] == "leave":  # ends with a thread running, an atexit function and a file left open, buffered
    import atexit, threading
    atexit.register(lambda: open("atexit.txt", "w").write("ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), open("thread.txt", "w").write("joined"))).start()
    LEFT_OPEN = open("buffered.txt", "w")
    LEFT_OPEN.write("kept " * 3)
    sys.exit(int(sys.argv[2]))
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


def test_a_forked_task_ends_without_the_teardown_yet_keeps_what_it_wrote_and_its_exit_status(task_dir):
    """A task forked by the server skips tearing down the modules the server imported (most of a job's CPU after its
    run), but ends as the interpreter would otherwise: its non-daemon thread joined, its atexit function run, a file it
    left open flushed, its exit status passed on."""
    with WarmStarter(preload=()) as starter:
        proc = client(starter, task_dir, "leave", "5", stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 5 and "warm start: task " in err  # forked, not run cold
    assert (task_dir / "atexit.txt").read_text() == "ran" and (task_dir / "thread.txt").read_text() == "joined"
    assert (task_dir / "buffered.txt").read_text() == "kept " * 3


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
        sock = Path(starter.python.split()[-1])
        assert sock.parent.stat().st_mode & 0o777 == 0o700
        assert sock.stat().st_mode & 0o777 == 0o600  # whatever the umask: connecting needs write permission


def test_a_task_sees_its_clients_environment_and_the_server_holds_no_secret(task_dir, monkeypatch):
    """A forked task's os.environ is its client's; its /proc/self/environ is the server's as the server started,
    which the server cleared of secrets (by running itself again) before it listened."""
    monkeypatch.setenv("WARM_PROBE_TOKEN", "s3cret-of-the-launcher")
    monkeypatch.setenv("WARM_SERVER_ONLY", "plain")
    with WarmStarter(preload=()) as starter:
        monkeypatch.delenv("WARM_SERVER_ONLY")
        proc = client(starter, task_dir, "report", "0", env={"WARM_PROBE": "mine",
                                                              "WARM_PROBE_TOKEN": "s3cret-of-the-job"},
                      stdout=subprocess.PIPE)
        seen = json.loads(proc.communicate(timeout=60)[0])
        server_environ = Path(f"/proc/{starter.pid}/environ").read_bytes()
    assert proc.returncode == 0 and seen["ppid"] == starter.pid  # forked
    assert seen["env"] == "mine" and seen["token"] == "s3cret-of-the-job"
    assert "WARM_SERVER_ONLY=plain" in seen["proc_environ"] and "WARM_PROBE=mine" not in seen["proc_environ"]
    assert not [e for e in seen["proc_environ"] if "s3cret" in e] and b"s3cret" not in server_environ


def test_a_client_of_other_thread_settings_starts_cold(task_dir):
    """torch fixes its thread count from OMP_NUM_THREADS when the server imports it: a task forked for a client of
    another value would run with the server's."""
    other = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    with WarmStarter(preload=()) as starter:
        proc = client(starter, task_dir, "report", "0", env={"OMP_NUM_THREADS": other}, stdout=subprocess.PIPE)
        seen = json.loads(proc.communicate(timeout=60)[0])
    assert proc.returncode == 0 and seen["pid"] == proc.pid


# --- another user's server: nothing is sent to it --------------------------------------------------------------

FAKE = r'''
import json, os, socket, sys
folder, identity = sys.argv[1], sys.argv[2]
with open(os.path.join(folder, "identity.json"), "w") as handle:
    handle.write(identity)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(os.path.join(folder, "socket"))
listener.listen(8)
open(os.path.join(folder, "ready"), "w").close()
while True:
    conn, _ = listener.accept()
    conn.settimeout(5)
    data, fds = b"", 0
    try:
        while True:
            chunk, got, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            fds += len(got)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    with open(os.path.join(folder, "received"), "a") as handle:
        handle.write(json.dumps({"bytes": len(data), "fds": fds, "text": data.decode(errors="replace")}) + "\n")
    conn.close()
'''
"""What another user could leave listening: it records each connection (bytes and descriptors it was sent)."""


class OtherUsersServer:
    def __init__(self, public: Path):
        self.public, self.socket = public, public / "socket"
        self.private = public.with_name(public.name + "-private")

    def received(self, connections: int = 0) -> list[dict]:
        """What it was sent, once it has recorded `connections` connections (or after a moment)."""
        record = self.public / "received"
        deadline = time.monotonic() + (10 if connections else 0.5)
        while time.monotonic() < deadline and (record.read_text().count("\n") if record.exists() else 0) < connections:
            time.sleep(0.02)
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    def behind_a_private_socket(self) -> Path:
        """Its socket moved into a folder of this user's alone (0700, with this process's identity beside it) and
        made this user's (0600): only the process listening on it tells."""
        self.private.mkdir(mode=0o700)
        sock = self.private / "socket"
        os.rename(self.socket, sock)  # the same file system: the socket stays bound to its listener
        os.chown(sock, os.geteuid(), os.getegid())
        os.chmod(sock, 0o600)
        (self.private / warm.IDENTITY).write_text(json.dumps(warm._identity()))
        return sock


@pytest.fixture
def other_users_server():
    """`FAKE` run as `nobody` in a folder everyone can write (mode 1777, under /tmp: the test's own folder is root's
    alone), with this process's identity beside its socket. Needs root and a Python `nobody` can run."""
    import pwd

    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root and a system python3 to run a server as another user")
    nobody = pwd.getpwnam("nobody")
    public = Path(tempfile.mkdtemp(prefix="warm-public-"))
    public.chmod(0o1777)
    proc = subprocess.Popen([python, "-c", FAKE, str(public), json.dumps(warm._identity())], cwd=public,
                            env={"PATH": "/usr/bin:/bin"}, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[])
    try:
        deadline = time.monotonic() + 30
        while not (public / "ready").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not (public / "ready").exists():
            pytest.skip(f"{python} did not run as nobody")
        assert (public / "socket").stat().st_uid == nobody.pw_uid
        server = OtherUsersServer(public)
        yield server
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(public, ignore_errors=True)
        shutil.rmtree(public.with_name(public.name + "-private"), ignore_errors=True)


def _refusal(server: OtherUsersServer, where: str) -> tuple[Path, str, list[dict]]:
    """The socket a client is pointed at, why it must refuse it, and what the server records: nothing at all where
    the folder's checks refuse it; an empty connection where only its listener's uid can (known once connected)."""
    if where == "folder others can write":
        return server.socket, f"other users can write the folder {server.public} (mode 1777)", []
    sock = server.behind_a_private_socket()
    return (sock, f"the server on {sock} runs as uid 65534, not as this user (uid 0)",
            [{"bytes": 0, "fds": 0, "text": ""}])


WHERE = ["folder others can write", "private socket, another user's process"]


@pytest.mark.parametrize("where", WHERE)
def test_a_client_sends_nothing_to_another_users_server_and_starts_cold(where, other_users_server, task_dir):
    sock, why, recorded = _refusal(other_users_server, where)
    proc = client(f"{sys.executable} -m study.launch.warm {sock}", task_dir, "report", "0",
                  env={"WARM_PROBE_TOKEN": "s3cret"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    seen = json.loads(out)
    assert proc.returncode == 0 and seen["pid"] == proc.pid and seen["token"] == "s3cret"  # started cold
    assert err == (f"warm start: refused: {why}; nothing was sent to it, the job starts as a plain process\n"
                   "to stderr\n")
    assert other_users_server.received(len(recorded)) == recorded


@pytest.mark.parametrize("where", WHERE)
def test_a_named_server_of_another_user_is_refused_by_name(where, other_users_server, monkeypatch):
    """`STUDY_WARM_SERVER` set to it: `shared()` (and so a local launch) refuses it naming the variable, starts no
    server of its own, and sends it nothing."""
    from study.errors import StudyError

    sock, why, recorded = _refusal(other_users_server, where)
    monkeypatch.setattr(warm, "_SHARED", [])
    monkeypatch.setenv(warm.ENV, str(sock))
    with pytest.raises(StudyError) as refused:
        warm.shared()
    assert refused.value.field == warm.ENV and refused.value.problem.startswith(f"{sock}: {why}, so ")
    assert 'warm serve "$(mktemp -d)"' in refused.value.fix
    assert warm._SHARED == []
    assert other_users_server.received(len(recorded)) == recorded


def test_a_server_refuses_a_client_of_another_user(task_dir, capfd):
    """A socket another user can reach (its folder and socket opened up by hand): their request, though it names
    this server's interpreter and environment, is refused before it is read, and no task is forked."""
    import pwd

    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root and a system python3 to run a client as another user")
    nobody = pwd.getpwnam("nobody")
    request = {"argv": ["-m", "warmtask", "wait"], "cwd": str(task_dir), "python": sys.executable,
               "env": {k: v for k, v in os.environ.items() if k in warm.IMPORTED_ENV}}
    send = ("import os, socket, struct, sys\n"
            "conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "conn.connect(sys.argv[1])\n"
            "body = sys.argv[2].encode()\n"
            "null = os.open(os.devnull, os.O_RDWR)\n"
            "conn.settimeout(30)\n"
            "try:\n"
            "    socket.send_fds(conn, [struct.pack('!I', len(body))], [null] * 3)\n"
            "    conn.sendall(body)\n"
            "    print(repr(conn.recv(100)))\n"
            "except (BrokenPipeError, ConnectionResetError):\n"  # closed before it read the request
            "    print(repr(b''))\n")
    with WarmStarter(preload=()) as starter:
        sock = Path(starter.python.split()[-1])
        sock.parent.chmod(0o711)
        sock.chmod(0o666)
        out = subprocess.run([python, "-c", send, str(sock), json.dumps(request)], cwd="/", capture_output=True,
                             text=True, env={"PATH": "/usr/bin:/bin"}, user=nobody.pw_uid, group=nobody.pw_gid,
                             extra_groups=[], timeout=60)
        assert out.stdout == "b''\n", out.stderr  # closed without a task's pid
        time.sleep(0.5)
        assert not (task_dir / "started").exists()
    assert ("warm start: request refused: a client of uid 65534 is not this server's user (uid 0)"
            in capfd.readouterr().err)


# --- a server that answers nonsense ------------------------------------------------------------------------------

def _nonsense_server(folder: Path, answer: bytes) -> Path:
    """A server of this user that reads one request and answers `answer`, then waits for its client to go."""
    folder.mkdir(mode=0o700)
    sock = folder / "socket"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    sock.chmod(0o600)
    listener.listen(8)

    def serve():  # one client
        with listener, listener.accept()[0] as conn:
            for fd in warm._receive(conn, with_fds=True)[1]:
                os.close(fd)
            conn.sendall(answer)
            try:
                conn.recv(1)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return sock


def _message(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return warm._HEADER.pack(len(data)) + data


@pytest.mark.parametrize("case", ["garbage", "pid 1", "no status"])
def test_a_server_that_answers_nonsense_fails_the_job_saying_what_it_answered(case, task_dir, tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])  # a child of this process, which is the fake server
    answers = {"garbage": (b"HTTP/1.1 400 Bad Request\r\n\r\n",
                           "answered b'HTTP'..., the start of a 1213486160-byte message, where its task's pid belongs"),
               "pid 1": (_message({"pid": 1}), "named process 1 as its task, which it did not fork"),
               "no status": (_message({"pid": sleeper.pid}) + _message({"status": "done"}),
                             "answered b'{\"status\": \"done\"}' where its task's wait status belongs")}
    answer, said = answers[case]
    sock = _nonsense_server(tmp_path / "srv", answer)
    proc = client(f"{sys.executable} -m study.launch.warm {sock}", task_dir, "report", "0",
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        for child in (proc, sleeper):  # a client that took the answer for a pid would wait on it for ever
            child.kill()
            child.wait()
    assert (proc.returncode, out) == (1, "")
    assert err == (f"warm start: the server on {sock} {said}; the job is not run (stop the process listening there, "
                   "or launch with cluster.warm_start=false)\n")


def test_a_launch_names_the_nonsense_a_server_answered_as_its_jobs_failure(tmp_path):
    """What `study launch` shows for a failed local job (`failure_reason`): the client's line, not submitit's rule."""
    import submitit

    from study.launch.local import failure_reason

    sock = _nonsense_server(tmp_path / "srv", b"nonsense")
    executor = submitit.LocalExecutor(folder=str(tmp_path / "jobs"),
                                      python=f"{sys.executable} -m study.launch.warm {sock}")
    job = executor.submit(os.getpid)
    job._results_timeout_s = 0
    job.wait()
    assert failure_reason(job.exception()) == (
        f"warm start: the server on {sock} answered b'nons'..., the start of a 1852796531-byte message, where its "
        "task's pid belongs; the job is not run (stop the process listening there, or launch with "
        "cluster.warm_start=false)")


def test_a_job_that_ends_without_a_result_or_a_line_is_described_not_shown_as_a_rule(tmp_path):
    """A job whose process exits at once, writing nothing (killed, or a command that fails before it logs), leaves
    submitit's message ending in a rule of dashes over an empty log: the reason says what happened and where to
    look."""
    import submitit

    from study.launch.local import failure_reason

    executor = submitit.LocalExecutor(folder=str(tmp_path / "jobs"), python="/bin/false")
    job = executor.submit(os.getpid)
    job._results_timeout_s = 0
    job.wait()
    assert "-" * 40 in str(job.exception())  # the message this reads: submitit's, with its rule
    assert failure_reason(job.exception()) == (
        f"the job ended without a result or a line of output ({job.paths.stdout})")


# --- `serve` ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing", "others can write", "another user's", "a file"])
def test_serve_refuses_a_folder_that_is_missing_another_users_or_writable_by_others(case, tmp_path):
    folder = tmp_path / "srv"
    problem, fix = "", 'serve from a folder that is yours and only you can write, e.g. `python -m study.launch.warm ' \
                       'serve "$(mktemp -d)"`'
    if case == "missing":
        problem, fix = "no such folder", f"create it, for you alone (`mkdir -m 700 {folder}`), or {fix}"
    elif case == "a file":
        folder.write_text("")
        problem = "cannot serve from it (Not a directory)"
    else:
        folder.mkdir()
        folder.chmod(0o1777 if case == "others can write" else 0o700)
        if case == "another user's":
            if os.geteuid() != 0:
                pytest.skip("needs root to give a folder to another user")
            os.chown(folder, 65534, 65534)
            problem = f"the folder {folder} belongs to uid 65534, not to this user (uid 0)"
        else:
            problem = f"other users can write the folder {folder} (mode 1777)"
    before = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None
    done = subprocess.run([sys.executable, "-m", "study.launch.warm", "serve", str(folder), ""], capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"study.launch.warm serve: error in `{folder}`: {problem}. Fix: {fix}\n"
    assert (sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None) == before  # nothing written


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
