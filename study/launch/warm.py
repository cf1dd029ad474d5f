"""Warm starts for local jobs: one process per launching process imports torch and MLflow once, and each job's task
is forked from it instead of importing them anew (about 5 of the 7 CPU seconds a tiny run takes on a laptop).

`shared()` (used by `study.launch.local.run_local`) starts `python -m study.launch.warm serve DIR`, which listens on
`DIR/socket` (a folder only this user can enter) before it imports anything, so no job waits on a missing server.
submitit's local controller runs each task as `python -m study.launch.warm SOCKET -u -m submitit.core._submit FOLDER`
(the executor's `python`): that client hands the server its command, working directory, environment and standard
streams, then stands in for the forked task: the signals it gets go to the task (TERM stops a run at a checkpoint),
it exits as the task did (its code, or killed by the same signal), and killed itself it takes its task with it
(SIGKILL). Where no server answers, the client runs the same command as a plain process.

Nothing reaches a process the launching user does not own. Before it sends anything a client checks that the socket
and its folder are its user's and that no other user can write them (another could have put a server there, or
replace this one), then that the process listening is its user's (SO_PEERCRED); failing that it sends nothing and the
job starts as a plain process, saying why on its standard error. A server refuses a folder that is missing, another
user's or writable by others, and a client of another user (SO_PEERCRED). An answer that is not a task's pid (one
the server forked) or a wait status ends the client with a line that says what came back.

The server holds nothing a task could share by mistake: no thread, no open store, no study module but its error type
(settings are read from the task's own environment after the fork), and only the standard library before the fork,
so a client starts in milliseconds; it stops taking jobs when its launcher ends or dies, and exits once its tasks
have. A task's `os.environ` (so `getenv` and its children) is its client's, yet its `/proc/PID/environ` shows the
environment the server was started with (what exec wrote; a fork copies it): so `serve` runs itself again without the
variables that hold secrets (`study.config.secrets`) before it listens. It forks only for clients of its own
interpreter, PYTHONPATH and OMP_NUM_THREADS / MKL_NUM_THREADS (torch fixes its thread count when imported); any other
client, or a socket that is gone, starts its job cold.

A server started on its own (`python -m study.launch.warm serve DIR`, stopped by TERM or when its parent exits) serves
every launch whose environment names its socket in `STUDY_WARM_SERVER`, so a shell or a test session pays the imports
once; a named socket that fails the checks above is refused by name (`StudyError`) before a launch writes anything.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
from contextlib import AbstractContextManager, suppress

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "mlflow",
           "mlflow.store.tracking.sqlalchemy_store", "submitit", "hydra")
"""What a training task imports that takes seconds: torch (1.3 s), torch._dynamo (1.2 s: the first optimizer step and
the model's init import it), MLflow (1.7 s) and its SQLite store (1.0 s); and Hydra with OmegaConf (0.35 s, a fifth
of what a tiny run's task still spends once the rest is preloaded)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
             signal.SIGCONT)
"""What the client passes on to its task: submitit's local controller stops and warns tasks with these."""
_HEADER = struct.Struct("!I")
ENV = "STUDY_WARM_SERVER"
"""A running server's socket that `shared()` uses instead of starting one."""
IDENTITY = "identity.json"
"""Beside the socket: the interpreter and environment (`IMPORTED_ENV`) the server forks for (it refuses other
clients)."""
IMPORTED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""What the server's imports depend on besides its interpreter: the code on the path, and the thread count torch
fixes when it is imported. A client whose values differ from the server's starts cold."""
_SERVE = "_serve"
"""`serve` as it runs itself again, its environment cleared of secrets (`main`)."""
_ANSWER_MAX = 1 << 10
"""A server's answer is one number: a longer one is nonsense, not something to wait for."""
_PEERCRED = struct.Struct("3i")


class Untrusted(Exception):
    """A socket another user could have put there or could replace (it, or its folder, is theirs or writable by
    others), or that a process of another user listens on: nothing is sent to it."""


class _Nonsense(Exception):
    """A server's answer that is not what the protocol says (a task's pid, its wait status)."""


def _private(path: str, what: str, info: os.stat_result) -> None:
    me = os.geteuid()
    if info.st_uid != me:
        raise Untrusted(f"the {what} {path} belongs to uid {info.st_uid}, not to this user (uid {me})")
    if info.st_mode & 0o022:
        raise Untrusted(f"other users can write the {what} {path} (mode {stat.S_IMODE(info.st_mode):o})")


def _check_folder(folder: str) -> None:
    """Raises Untrusted when `folder` is another user's or others can write it; OSError when it is missing."""
    info = os.stat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), folder)
    _private(folder, "folder", info)


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of `conn`, as the kernel recorded them (SO_PEERCRED)."""
    pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def _connect(sock: str) -> tuple[socket.socket, int]:
    """A connection to the server at `sock` and its pid, once the socket, its folder and the process listening are
    this user's and no one else can write them: Untrusted when not (before a byte is sent), OSError when no server
    is there."""
    _check_folder(os.path.dirname(os.path.abspath(sock)))
    info = os.lstat(sock)
    if not stat.S_ISSOCK(info.st_mode):
        raise Untrusted(f"{sock} is not a socket")
    _private(sock, "socket", info)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock)  # a socket file its crashed server left behind refuses
        # the path could have been swapped since the checks above: what counts is who listens
        pid, uid = _peer(conn)
        if uid != os.geteuid():
            raise Untrusted(f"the server on {sock} runs as uid {uid}, not as this user (uid {os.geteuid()})")
    except BaseException:
        conn.close()
        raise
    return conn, pid


def _send(conn: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(conn, [data], fds) if fds else 0  # the descriptors ride on the first bytes
    if sent < len(data):  # sendall sends even nothing, to a peer that may have answered and closed by now
        conn.sendall(data[sent:])


def _exactly(conn: socket.socket, n: int, first: bytes = b"") -> bytes:
    data = first
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        data += chunk
    return data


def _receive(conn: socket.socket, with_fds: bool = False) -> tuple[dict, list[int]]:
    head, fds = b"", []
    try:
        if with_fds:  # they come with the first bytes
            head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        (size,) = _HEADER.unpack(_exactly(conn, _HEADER.size, head))
        return json.loads(_exactly(conn, size)), fds
    except BaseException:
        for fd in fds:  # a message cut short: the descriptors it carried are not kept open here
            os.close(fd)
        raise


# --- the launcher's side -----------------------------------------------------------------------------------------

class WarmStarter(AbstractContextManager):
    """A server: `python` is the executor's interpreter command while it serves (None when it could not start: jobs
    then start as plain processes). Closing it lets the server finish its running tasks and exit; it takes no new
    ones. Its own messages (a module it could not preload, a refused client) go to this process's standard error."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, ready_s: float = 10.0, socket_path: str | None = None):
        import shutil
        import subprocess
        import tempfile

        self.python: str | None = None
        self.identity = _identity()  # the clients its server forks for
        self._dir: str | None = None
        self._proc = None
        self._socket = socket_path
        if socket_path is not None:  # someone else's server: used while it answers, never stopped here
            self.python = f"{sys.executable} -m {__name__} {socket_path}"
            return
        self._dir = tempfile.mkdtemp(prefix="study-warm-")  # 0700: only this user reaches the socket
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, "serve", self._dir, ",".join(preload)],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except OSError:
            shutil.rmtree(self._dir, ignore_errors=True)
            return
        sock = os.path.join(self._dir, "socket")
        deadline = time.monotonic() + ready_s
        while not os.path.exists(sock) and self._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.path.exists(sock):
            self.python = f"{sys.executable} -m {__name__} {sock}"
        else:
            self.close()

    @property
    def pid(self) -> int | None:
        """The server's process id."""
        return self._proc.pid if self._proc is not None else None

    def serving(self) -> bool:
        if self._socket is not None:
            try:
                return _serves_me(self._socket)
            except Untrusted:
                return False
        return self.python is not None and self._proc is not None and self._proc.poll() is None

    def close(self, wait_s: float = 5.0) -> None:
        import shutil
        import subprocess

        self.python = None
        if self._dir is None:
            return  # not this process's server
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)  # no new tasks; it exits once its running ones have
            with suppress(subprocess.TimeoutExpired):  # tasks still running: it exits after them
                self._proc.wait(wait_s)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()


_SHARED: list[WarmStarter] = []


def shared() -> WarmStarter:
    """The server named by `STUDY_WARM_SERVER` while it answers and forks for this process (`named_server`); else this
    process's server, started on its first local launch and closed when the process exits: a process that launches
    again (`--until-decided`'s rounds, a script) forks every job from one. Started again when it has died or PYTHONPATH
    or the thread settings have changed (it would refuse every job: `IMPORTED_ENV`)."""
    import atexit

    outside = named_server()
    if outside:
        return WarmStarter(socket_path=outside)
    if not _SHARED or not _SHARED[0].serving() or _SHARED[0].identity != _identity():
        if _SHARED:
            _SHARED.pop().close(wait_s=0)
        _SHARED.append(WarmStarter())
        atexit.register(_SHARED[0].close)
    return _SHARED[0]


def named_server() -> str | None:
    """The socket `STUDY_WARM_SERVER` names while a server answers there and forks for this process (`_serves_me`);
    None when it names none, or one that is gone or forks for other code (this process then starts its own). One that
    another user could have put there is refused by name (StudyError): every job would hand it its environment."""
    sock = os.environ.get(ENV)
    if not sock:
        return None
    try:
        return sock if _serves_me(sock) else None
    except Untrusted as err:
        from study.errors import StudyError

        raise StudyError(ENV, f"{sock}: {err}, so the process listening there could be another user's, and each job "
                         "would hand it its environment (secrets included) and streams",
                         "serve from a folder that is yours and only you can write: `python -m study.launch.warm serve "
                         f"\"$(mktemp -d)\"`, then point {ENV} at that folder's socket; or unset {ENV}") from None


def _serves_me(sock: str) -> bool:
    """The server at `sock` answers and forks for this interpreter and environment (else its every job would start
    cold, where a server of this process's own would fork them). Untrusted when it could be another user's."""
    try:
        conn, _ = _connect(sock)
        conn.close()
        with open(os.path.join(os.path.dirname(sock), IDENTITY)) as handle:  # in the folder just checked
            identity = json.load(handle)
    except (OSError, ValueError):
        return False
    return identity == _identity()


def _identity(python: str = sys.executable, env=os.environ) -> dict:
    return {"python": python, **{name: env.get(name) for name in IMPORTED_ENV}}


# --- the server ----------------------------------------------------------------------------------------------------

def _run_task(request: dict, fds: list[int]) -> None:
    """What a forked child runs: a client's command, with the client's streams, directory and environment."""
    for sig in (*FORWARDED, signal.SIGCHLD):  # as a fresh interpreter has them (SIGPIPE stays ignored)
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # held since the fork: delivered now, to these
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    print(f"warm start: task {os.getpid()} forked by server {os.getppid()}", file=sys.stderr, flush=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered, module, args = _parse(request["argv"])
    if unbuffered:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [module, *args]
    sys.path[0] = request["cwd"]  # as `python -m` puts it
    import runpy

    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _parse(argv: list[str]) -> tuple[bool, str, list[str]]:
    """`[-u] -m MODULE ARGS...`: the only interpreter command a server runs (anything else starts cold)."""
    unbuffered = argv[:1] == ["-u"]
    rest = argv[1:] if unbuffered else argv
    if len(rest) < 2 or rest[0] != "-m":
        raise ValueError(f"not a `[-u] -m MODULE` command: {argv}")
    return unbuffered, rest[1], rest[2:]


def serve(folder: str, preload: tuple[str, ...] = PRELOAD, poll_s: float = 0.2) -> tuple[dict, list[int]] | None:
    """Take jobs on `folder/socket` until told to stop (TERM) or the launcher is gone, then wait for the running
    ones. Returns the task to run in a forked child (its request and streams, for `_run_task`), None in the server
    when it is done."""
    import gc
    import importlib

    launcher = os.getppid()
    path = os.path.join(folder, "socket")
    listener = _listen(folder, path)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the tasks themselves; the server outlives them
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as err:  # a task imports it again and reports the error itself
            print(f"warm start: not preloaded: {name}: {err}", file=sys.stderr, flush=True)
    gc.freeze()  # what the tasks share: never collected, and left out of what a task's exit looks through
    tasks: dict[int, socket.socket | None] = {}  # a task whose client is gone: None
    me = os.geteuid()
    while True:
        _reap(tasks)
        done = bool(stopping) or os.getppid() != launcher
        if done and listener.fileno() >= 0:
            listener.close()
            with suppress(OSError):
                os.unlink(path)
        if done and not tasks:
            return None
        watched = [c for c in tasks.values() if c is not None] + ([] if done else [listener])
        # a signal (TERM: stop) does not end the wait early: select retries (PEP 475), at most poll_s on
        readable, _, _ = select.select(watched, [], [], poll_s)
        for conn in readable:
            if conn is listener:
                child = _accept(listener, tasks, me)
                if child is not None:
                    return child
            else:
                # a task's client never writes: readable means it is gone (killed), and its task goes with it
                pid = next(p for p, c in tasks.items() if c is conn)
                try:
                    gone = not conn.recv(1)
                except OSError:  # reset: the client was killed before it read its task's pid
                    gone = True
                if gone:
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    conn.close()
                    tasks[pid] = None  # reaped on a later pass; no client is left to tell


def _listen(folder: str, path: str) -> socket.socket:
    """The server's socket at `path` in `folder`, its identity beside it, reachable by this user alone. StudyError
    when the folder is missing, another user's or writable by others (one of them could replace the socket and be
    handed every job's environment), or something is at `path` already."""
    from study.errors import StudyError

    fix = "serve from a folder that is yours and only you can write, e.g. `python -m study.launch.warm serve " \
          '"$(mktemp -d)"`'
    try:
        _check_folder(folder)
    except FileNotFoundError:
        raise StudyError(folder, "no such folder", f"create it, for you alone (`mkdir -m 700 {folder}`), or {fix}") \
            from None
    except Untrusted as err:
        raise StudyError(folder, str(err), fix) from None
    except OSError as err:
        raise StudyError(folder, f"cannot serve from it ({err.strerror or err})", fix) from None
    if os.path.lexists(path):
        raise StudyError(path, "is there already: a server listens on it, or one that was killed left it behind",
                         "stop that server (TERM), or remove the file, or serve from another folder")
    with open(os.path.join(folder, IDENTITY), "w") as handle:  # before the socket: whoever finds one finds both
        json.dump(_identity(), handle)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # the socket is this user's alone from the moment it exists (connecting needs write)
    try:
        listener.bind(path)
    except OSError as err:
        listener.close()
        raise StudyError(path, f"cannot listen there ({err.strerror or err})",
                         "serve from a folder with a shorter path, e.g. `mktemp -d`") from None
    finally:
        os.umask(umask)
    listener.listen(64)  # clients queue here while the server imports its modules
    return listener


def _accept(listener: socket.socket, tasks: dict[int, socket.socket | None],
            me: int) -> tuple[dict, list[int]] | None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        uid = _peer(conn)[1]
        if uid != me:  # before a byte is read: its request would run as this user
            raise PermissionError(f"a client of uid {uid} is not this server's user (uid {me})")
        conn.settimeout(10)
        request, fds = _receive(conn, with_fds=True)
        _parse(request["argv"])
        theirs, mine = _identity(request["python"], request["env"]), _identity()
        if theirs != mine:
            differ = ", ".join(f"{k} {theirs[k]!r} (this server: {mine[k]!r})" for k in mine if theirs[k] != mine[k])
            raise ValueError(f"a client of {differ} would run other code, or other threads, than this server "
                             "imported (it starts cold)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # a request of another shape too
        if fds or not isinstance(err, ConnectionError):  # (no request at all: `shared()` probing that it answers)
            print(f"warm start: request refused: {err}", file=sys.stderr, flush=True)
        for fd in fds:  # the streams of a refused client
            os.close(fd)
        conn.close()
        return None
    # a signal its client forwards as soon as it learns the pid must reach the task's own handlers, not the server's
    # (which would swallow TERM and ignore INT): held from the fork until the child has reset them
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in tasks.values():
            if other is not None:
                other.close()
        conn.close()
        return request, fds
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    for fd in fds:
        os.close(fd)
    tasks[pid] = conn
    try:
        _send(conn, {"pid": pid})
    except OSError:
        os.kill(pid, signal.SIGKILL)  # its client is already gone
    return None


def _reap(tasks: dict[int, socket.socket | None]) -> None:
    while tasks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = tasks.pop(pid, None)
        if conn is not None:
            with suppress(OSError):
                _send(conn, {"status": status})
            conn.close()


# --- the client ----------------------------------------------------------------------------------------------------

def client(sock: str, argv: list[str]) -> None:
    """Stand in for `python ARGV` run by the server: forward signals to the task, exit as it did."""
    pending: list[int] = []
    for sig in FORWARDED:  # a signal before the task exists is passed on once it does
        signal.signal(sig, lambda s, _: pending.append(s))
    try:
        _parse(argv)
        conn, server = _connect(sock)
        _send(conn, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "python": sys.executable},
              fds=[0, 1, 2])
        pid = _answer(conn, "pid")
        if not _forked_by(server, pid):  # else its signals would go to a process it did not start
            raise _Nonsense(f"named process {pid} as its task, which it did not fork")
    except Untrusted as err:
        print(f"warm start: refused: {err}; nothing was sent to it, the job starts as a plain process",
              file=sys.stderr, flush=True)
        _cold(argv, pending)
    except _Nonsense as err:
        _failed(sock, err)
    except (OSError, ValueError):  # no server (or not a `-m` command), or it refused the request: nothing forked
        _cold(argv, pending)

    def forward(sig, _frame):
        with suppress(ProcessLookupError):
            os.kill(pid, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for sig in pending:
        forward(sig, None)
    try:
        status = _answer(conn, "status")
        if not 0 <= status <= 0xFFFF or not (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
            raise _Nonsense(f"answered {status}, which is no wait status, for its task {pid}")
    except _Nonsense as err:
        _failed(sock, err)  # closing the connection ends the task too, as if this client were killed
    except OSError:  # closed or reset before the status came
        # the server died before its task (it never exits first): wait for the task, then say what is known
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(0.5)
        print(f"warm start: lost the exit status of task {pid}", file=sys.stderr, flush=True)
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _cold(argv: list[str], pending: list[int]) -> None:
    """Become `python ARGV` (no server, or none to trust), with the signals that came before as they would have."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    for sig in pending:  # what it would have done to the task
        os.kill(os.getpid(), sig)
    os.execv(sys.executable, [sys.executable, *argv])


def _failed(sock: str, err: _Nonsense) -> None:
    # the launch names a failed job by its last line on standard error: this one says what happened
    print(f"warm start: the server on {sock} {err}; the job is not run (stop the process listening there, or "
          "launch with cluster.warm_start=false)", file=sys.stderr, flush=True)
    os._exit(1)


def _answer(conn: socket.socket, key: str) -> int:
    """The number in the server's answer `{key: N}` (its task's pid, then its wait status); _Nonsense when the answer
    is anything else, ConnectionError when the connection closes first."""
    what = {"pid": "its task's pid", "status": "its task's wait status"}[key]
    head = _exactly(conn, _HEADER.size)
    (size,) = _HEADER.unpack(head)
    if size > _ANSWER_MAX:
        raise _Nonsense(f"answered {head!r}..., the start of a {size}-byte message, where {what} belongs")
    body = _exactly(conn, size)
    try:
        value = json.loads(body)[key]
    except (ValueError, TypeError, KeyError, IndexError):
        value = None
    if type(value) is not int:
        raise _Nonsense(f"answered {body[:200]!r} where {what} belongs")
    return value


def _forked_by(server: int, pid: int) -> bool:
    """`pid` is a child of the process `server`, or is gone already (a task that ended at once: its status follows).
    0, 1 and negative numbers never are: a signal forwarded there would reach a process group, init or every
    process."""
    if pid <= 1:
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    except FileNotFoundError:
        return True
    return int(fields[1]) == server


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        # become the server (`_SERVE ARGS`) without the variables that hold secrets (`study.config.secrets`): a forked
        # task's /proc/PID/environ shows the server's (see the module's docstring); run again whatever the environment
        # holds, so the server never imports what this check needs
        from study.config.secrets import mask_text

        kept = {name: value for name, value in os.environ.items() if mask_text(f"{name}={value}") == f"{name}={value}"}
        os.execve(sys.executable, [sys.executable, "-m", "study.launch.warm", _SERVE, *argv[1:]], kept)
    if argv[:1] == [_SERVE]:
        from study.errors import StudyError

        preload = tuple(p for p in argv[2].split(",") if p) if len(argv) > 2 else PRELOAD  # "" preloads nothing
        try:
            if len(argv) < 2:
                raise StudyError("serve", "names no folder", 'name one only you can write: `python -m '
                                 'study.launch.warm serve "$(mktemp -d)"`')
            task = serve(argv[1], preload)
        except StudyError as err:
            print(f"study.launch.warm serve: {err.message}", file=sys.stderr, flush=True)
            sys.exit(2)
        if task is not None:
            try:
                _run_task(*task)  # in the forked child: runs to the end like the module would, exits as it does
            except SystemExit as done:
                _exit_without_teardown(done.code)
            _exit_without_teardown(0)
        return
    client(argv[0], argv[1:])


def _exit_without_teardown(code) -> None:
    """End a forked task as the interpreter would (its non-daemon threads joined, its atexit functions run, cyclic
    garbage finalised, the standard streams flushed), less tearing down every module the server imported: that
    teardown of torch and MLflow is about 1.6 CPU s a job, most of what a job spends after its run has ended."""
    import atexit
    import gc
    import io
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    gc.collect()  # what a file left open in a cycle would flush when finalised
    for generation in range(3):  # the task's own objects: the server froze what it had imported (`serve`)
        for obj in gc.get_objects(generation):
            if isinstance(obj, io.IOBase):
                with suppress(OSError, ValueError):  # a file the task left open: the teardown would have flushed it
                    obj.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # `sys.exit("message")`: printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
