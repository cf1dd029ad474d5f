"""The cluster that slurm/local/up starts is a working SLURM: batch jobs, accounting, job steps, requeue."""

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

UP = Path(__file__).resolve().parents[1] / "slurm" / "local" / "up"


def _job_env() -> dict[str, str]:
    """The caller's environment without the SLURM_* variables of any job pytest itself runs in."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def _run(*args: str, timeout: float = 30) -> str:
    done = subprocess.run(args, env=_job_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}): {done.stderr}"
    return done.stdout


def _wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `condition` every 0.2 s; return the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - start


def _sacct_state(job_id: str) -> str:
    return _run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State").strip()


def _sbatch(*args: str) -> str:
    return _run("sbatch", "--parsable", *args).strip().split(";")[0]


@pytest.fixture(scope="module", autouse=True)
def local_cluster() -> Path:
    """The SLURM_CONF of a running cluster; skip the module when there is none."""
    conf = os.environ.get("SLURM_CONF")
    if not conf:
        pytest.skip('SLURM_CONF is not set: start the local cluster with eval "$(slurm/local/up)"')
    if not Path(conf).is_file():
        pytest.skip(f"SLURM_CONF={conf} does not exist: start the local cluster with eval \"$(slurm/local/up)\"")
    if shutil.which("sinfo") is None:
        pytest.skip("sinfo is not installed: slurm/local/up installs SLURM")
    try:
        done = subprocess.run(["sinfo", "-h"], env=_job_env(), capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.skip(f"sinfo timed out: no cluster answers for SLURM_CONF={conf}")
    if done.returncode != 0:
        pytest.skip(f"sinfo fails for SLURM_CONF={conf}: {done.stderr.strip()}")
    return Path(conf)


def test_batch_job_writes_its_file_and_sacct_reports_completed(tmp_path: Path) -> None:
    job_id = _sbatch(
        f"--chdir={tmp_path}", "--output=slurm-%j.out", "--wrap", 'echo "hello from $SLURM_JOB_ID" > hello.txt'
    )
    _wait_until(lambda: _sacct_state(job_id) == "COMPLETED", 30, f"sacct shows job {job_id} COMPLETED")
    assert (tmp_path / "hello.txt").read_text() == f"hello from {job_id}\n"


def test_srun_inside_an_allocation_starts_two_distinct_ranks(tmp_path: Path) -> None:
    _run(
        "sbatch", "--wait", "--quiet", "--ntasks=2", f"--chdir={tmp_path}", "--output=ranks.txt",
        "--wrap", 'srun --ntasks=2 bash -c "echo \\$SLURM_PROCID/\\$SLURM_NTASKS"',
        timeout=60,
    )  # fmt: skip
    assert sorted((tmp_path / "ranks.txt").read_text().split()) == ["0/2", "1/2"]


def test_up_again_is_a_noop_that_prints_the_same_export_line(local_cluster: Path) -> None:
    base = local_cluster.parent
    if not (base / ".study-slurm").exists():
        pytest.skip(f"the cluster under {base} was not started by slurm/local/up")
    ctld_pid = (base / "run" / "slurmctld.pid").read_text()
    env = _job_env() | {"STUDY_SLURM_BASE": str(base)}
    start = time.monotonic()
    done = subprocess.run([str(UP)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"export SLURM_CONF={local_cluster}\n"
    assert time.monotonic() - start < 5, "a healthy cluster is left alone, not restarted"
    assert (base / "run" / "slurmctld.pid").read_text() == ctld_pid


@pytest.mark.integration
def test_scontrol_requeue_runs_the_job_again_with_restart_count_1(tmp_path: Path) -> None:
    runs = tmp_path / "restart_counts.txt"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f'echo "${{SLURM_RESTART_COUNT:-0}}" >> {runs}\n'
        '[ "${SLURM_RESTART_COUNT:-0}" = 0 ] && exec sleep 300\n'
        "true\n"
    )
    job_id = _sbatch(f"--chdir={tmp_path}", "--output=slurm-%j.out", str(script))
    try:
        _wait_until(lambda: runs.exists() and runs.read_text() == "0\n", 30, f"job {job_id} starts")
        _run("scontrol", "requeue", job_id)
        _wait_until(lambda: _sacct_state(job_id) == "COMPLETED", 45, f"requeued job {job_id} completes")
    finally:
        subprocess.run(["scancel", job_id], env=_job_env(), capture_output=True, timeout=10)
    assert runs.read_text().split() == ["0", "1"]
