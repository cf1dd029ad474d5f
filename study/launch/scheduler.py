"""What the scheduler knows: SLURM job states (squeue, then sacct), whether SLURM is reachable, whether a local job's
process still runs, and the job journal (<runs>/<experiment>/_launch/jobs.jsonl: every submission with the jobs it
waits for, so `study status` can name a run's job and a launch can tell a job that will never start)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path

from study.errors import StudyError
from study.files import TEXT, TEXTS, end_cut_line, file_lock, read_json_lines, shape_problem
from study.schema import launch_dir, not_a_link

ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD",
          "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}

DEAD = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
        "VANISHED"}

STUCK = "DEPENDENCY_NEVER_SATISFIED"
"""Not a SLURM state: a job PENDING that can never start. SLURM gives it the reason `DependencyNeverSatisfied` when a
job it waits for (afterok) failed or was cancelled; a job pending behind a stuck one keeps the reason `Dependency`,
yet it is stuck too. A relaunch cancels such jobs and submits their runs again."""


@contextmanager
def outside_allocation():
    """Submit as if from a login shell: inside a job (a controller job, an `salloc` shell) sbatch would pass that
    allocation's SLURM_* variables on to the new jobs, whose srun then refuses the mix ("SLURM_MEM_PER_CPU, ... are
    mutually exclusive"). SLURM_CONF, which names the cluster, and the user's SBATCH_* settings stay."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SLURM_") and k != "SLURM_CONF"}
    try:
        yield
    finally:
        os.environ.update(saved)


def journal_path(runs_root: str | Path, experiment: str) -> Path:
    """The job journal; a link in its place (or a linked `_launch/`) is refused, never appended through."""
    return not_a_link(launch_dir(runs_root, experiment) / "jobs.jsonl")


def append_lines(path: Path, entries: list[dict]) -> None:
    """The entries appended to a launch record as JSON lines, in one write, under the record's lock: a line a killed
    writer cut short is removed first (`end_cut_line`), so every line but a cut-short last one is whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(e) + "\n" for e in entries).encode()
    with file_lock(path):
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW)
        try:
            end_cut_line(fd)
            os.write(fd, data)
        finally:
            os.close(fd)


def journal(runs_root: str | Path, experiment: str) -> dict[str, dict]:
    """Latest submission per run key (and per `profile:<key>`, `prepare:<shards>`): job id, the job's kind (its
    `stage` field holds the word of a study.launch.kinds.JobKind), scheduler, run name, the job ids it waits for
    (`after`) and the launcher's host."""
    path = journal_path(runs_root, experiment)
    fields, present = {"key": TEXT, "job_id": TEXT, "scheduler": TEXT}, {"host": TEXT, "after": TEXTS}
    fix = (f"delete the damaged line of {path}, or the whole file once none of the experiment's jobs is queued or "
           "running (it only names the jobs each launch submitted)")
    return {e["key"]: e for e in read_json_lines(path, fix, lambda e: shape_problem(e, fields, present))}


def record(runs_root: str | Path, experiment: str, entries: list[dict]) -> None:
    append_lines(journal_path(runs_root, experiment), entries)


def _scheduler_lines(cmd: list[str]) -> list[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.splitlines() if out.returncode == 0 else []


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """State per job id (array tasks as `<job>_<task>`): squeue for live jobs (sacct can lag behind a submission),
    sacct for finished ones; `VANISHED` when neither knows the job, STUCK for a pending job whose dependency SLURM
    found can never be satisfied."""
    from submitit.slurm.slurm import read_job_id

    if not job_ids:
        return {}
    bases = ",".join(sorted({j.split("_")[0] for j in job_ids}))
    lines = _scheduler_lines(["sacct", "-n", "-P", "-X", "--format=JobID,State,Reason", "-j", bases])
    lines += _scheduler_lines(["squeue", "-h", "-o", "%i|%T|%r", "-j", bases])
    states: dict[str, str] = {}
    for line in lines:
        jid, state, reason = (line.split("|") + ["", ""])[:3]
        jid, state = jid.strip(), state.split()[0] if state.strip() else "UNKNOWN"
        if state == "PENDING" and reason.strip() == "DependencyNeverSatisfied":
            state = STUCK
        if "[" in jid:  # array tasks not started yet are listed as one line: 12_[3-8%4]
            for base, *bounds in read_job_id(jid):  # ("12", "3", "8"); ("12", "3") for one task
                states.update({f"{base}_{task}": state for task in range(int(bounds[0]), int(bounds[-1]) + 1)})
        states[jid] = state
    return {j: states.get(j, "VANISHED") for j in job_ids}


def job_states(entries: dict[str, dict]) -> dict[str, str]:
    """SLURM state per job id of the journal's SLURM jobs (and of the jobs they wait for), with every job pending
    behind a STUCK one STUCK too."""
    slurm = [e for e in entries.values() if e.get("scheduler") == "slurm"]
    states = slurm_states(sorted({e["job_id"] for e in slurm} | {j for e in slurm for j in e.get("after", [])}))
    while stuck := [e["job_id"] for e in slurm if states[e["job_id"]] == "PENDING"
                    and any(states.get(j) == STUCK for j in e.get("after", []))]:
        states.update(dict.fromkeys(stuck, STUCK))
    return states


def local_alive(entry: dict) -> bool:
    """A local job's process still runs: the journal entry was made on this machine and its process id still names
    submitit's local controller (an id the system has since given to another program does not count)."""
    if entry.get("host") != socket.gethostname():
        return False
    try:
        return b"submitit.local._local" in Path(f"/proc/{int(entry['job_id'])}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def cancel(job_ids: list[str]) -> None:
    _refuse_unless(["scancel", *job_ids], 30, f"scancel {' '.join(job_ids)} failed",
                   "check that SLURM is reachable (sinfo), then launch again",
                   "check the jobs with squeue, then launch again")


def check_slurm() -> None:
    _refuse_unless(["sinfo", "-h"], 10, "SLURM is not reachable",
                   "start it (eval \"$(slurm/local/up)\") or use cluster=local",
                   "check SLURM_CONF, or start the local cluster with eval \"$(slurm/local/up)\"")


def _refuse_unless(cmd: list[str], timeout_s: float, what: str, fix_unreachable: str, fix_failed: str) -> None:
    """Run a SLURM command; when it cannot run, or fails, the user reads `what`, the reason and the fix."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise StudyError("cluster", f"{what} ({err})", fix_unreachable) from None
    if done.returncode != 0:
        raise StudyError("cluster", f"{what}: {done.stderr.strip()}", fix_failed)
