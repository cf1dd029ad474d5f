"""The tests' MLflow server: a real `mlflow server` in its own process group: started on a free port, health-checked, stopped as a group.

`mlflow server` runs uvicorn as a child process, and SIGTERM to the CLI alone leaves that child serving, so
stopping signals the whole group, then SIGKILLs it after a grace period. The server's job runner (GenAI jobs: a pool of
huey consumers that doubles start time on 2 cores) is off unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION says otherwise.

    python tests/mlflow_server.py --backend sqlite:///$PWD/mlflow.db --artifacts $PWD/mlartifacts --port 5000

prints the URI, then serves until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from study.errors import StudyError


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may still take it before the server binds)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


@dataclass
class ServerHandle:
    """A running `mlflow server`: its URI, log, and the process group that `stop` ends."""

    backend_store_uri: str
    """Where runs are stored (an SQLAlchemy URI)."""
    artifacts_dir: Path
    """Where the server stores uploaded artifacts (`--artifacts-destination`)."""
    host: str
    """Interface the server binds."""
    port: int
    """Port the server listens on (kept across `restart`)."""
    workers: int
    """uvicorn worker processes."""
    log_path: Path
    """The server's stdout and stderr, appended across restarts."""
    timeout_s: float
    """How long a (re)start may take to answer /health."""
    process: subprocess.Popen | None = None
    """The `mlflow server` CLI, leader of its process group; None when stopped."""

    @property
    def uri(self) -> str:
        """The tracking URI clients use."""
        return f"http://{self._client_host}:{self.port}"

    @property
    def _client_host(self) -> str:
        return socket.getfqdn() if self._wildcard else self.host

    @property
    def _local_host(self) -> str:
        return "127.0.0.1" if self._wildcard else self.host

    @property
    def _wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::")

    def start(self) -> ServerHandle:
        """Starts the server (if not running) and waits until /health answers; StudyError with the log tail if it
        does not."""
        if self.process is not None and self.process.poll() is None:
            return self
        if _port_open(self._local_host, self.port):
            # Otherwise /health would be answered by whatever holds the port, while this server fails to bind.
            raise StudyError("port", f"port {self.port} on {self.host} is already in use", "pass another port, or 0")
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", self.backend_store_uri,
            "--artifacts-destination", str(self.artifacts_dir),
            "--host", self.host, "--port", str(self.port), "--workers", str(self.workers),
        ]  # fmt: skip
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        try:
            self._wait_healthy()
        except BaseException:
            # Also on Ctrl-C or SIGTERM while waiting: a half-started server must not outlive its starter.
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        health = f"http://{self._local_host}:{self.port}/health"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(health, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        code = self.process.poll()
        state = f"exited with status {code}" if code is not None else f"did not answer within {self.timeout_s:.0f} s"
        raise StudyError(
            "mlflow server", f"the server for {self.backend_store_uri} on port {self.port} {state}; "
            f"last lines of {self.log_path}:\n{self.log_tail()}",
            "read the log above (a port already in use? pass another port; a bad store URI? fix --backend)",
        )  # fmt: skip

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after `grace_s`; returns once the port is
        free."""
        if self.process is None:
            return
        pgid = self.process.pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The group outlives its leader while workers remain: SIGKILL whatever is still in it.
        _signal_group(pgid, signal.SIGKILL)
        self.process.wait()
        self.process = None
        deadline = time.monotonic() + grace_s
        while _port_open(self._local_host, self.port):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)

    def restart(self) -> ServerHandle:
        """Stops the server if it runs and starts it again on the same port."""
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the server log."""
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def start_server(
    backend_store_uri: str,
    artifacts_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 1,
    timeout_s: float = 90.0,
    log_path: str | Path | None = None,
) -> ServerHandle:
    """Starts `mlflow server` for `backend_store_uri` and returns once /health answers.

    `port=0` picks a free port. The log defaults to `mlflow-server.log` next to `artifacts_dir`. Binds 127.0.0.1
    unless `host` says otherwise (`0.0.0.0` for a cluster's compute nodes; then see mlflow's --allowed-hosts).
    """
    artifacts = Path(artifacts_dir).resolve()
    return ServerHandle(
        backend_store_uri=backend_store_uri,
        artifacts_dir=artifacts,
        host=host,
        port=port or free_port(host),
        workers=workers,
        log_path=Path(log_path) if log_path else artifacts.parent / "mlflow-server.log",
        timeout_s=timeout_s,
    ).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/mlflow_server.py", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=f"sqlite:///{Path.cwd() / 'mlflow.db'}", help="backend store URI")
    parser.add_argument("--artifacts", default=str(Path.cwd() / "mlartifacts"), help="artifact directory")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind")
    parser.add_argument("--port", type=int, default=5000, help="port (0 picks a free one)")
    parser.add_argument("--workers", type=int, default=1, help="uvicorn workers")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for /health")
    args = parser.parse_args(argv)

    def terminate(signum, frame):
        raise SystemExit(0)

    # Stopping happens in `finally`, not in the handler: the handler interrupts `wait()`, which holds the Popen's lock.
    signal.signal(signal.SIGTERM, terminate)
    try:
        server = start_server(args.backend, args.artifacts, args.host, args.port, args.workers, args.timeout)
    except StudyError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    print(server.uri, flush=True)
    try:
        code = server.process.wait()
        print(f"mlflow server exited with status {code}; last lines of {server.log_path}:\n{server.log_tail()}",
              file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
