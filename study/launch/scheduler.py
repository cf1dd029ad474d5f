"""What the scheduler knows: SLURM job states (squeue, then sacct), whether SLURM is reachable, and the job journal
(<runs>/<experiment>/_launch/jobs.jsonl: every submission, so `study status` can name a run's job)."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

from study.errors import StudyError
from study.schema import launch_dir

ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD",
          "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}


DEAD = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
        "VANISHED"}


@contextmanager
def outside_allocation():
    """Submit as if from a login shell. Inside a job (a controller job, an `salloc` shell) the environment holds that
    allocation's SLURM_* variables; sbatch would pass them on to the new jobs, whose srun then refuses the mix
    ("SLURM_MEM_PER_CPU, SLURM_MEM_PER_GPU, and SLURM_MEM_PER_NODE are mutually exclusive"). SLURM_CONF, which
    names the cluster, and the user's own SBATCH_* settings stay."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SLURM_") and k != "SLURM_CONF"}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def journal(runs_root: str | Path, experiment: str) -> dict[str, dict]:
    """Latest submission per run key (and per `profile:<key>`)."""
    path = launch_dir(runs_root, experiment) / "jobs.jsonl"
    out: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
                out[entry["key"]] = entry
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed launcher: the entries around it still count
    return out


def record(runs_root: str | Path, experiment: str, entries: list[dict]) -> None:
    path = launch_dir(runs_root, experiment) / "jobs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for e in entries:
            f.write(json.dumps(e) + "\n")


def slurm_jobs(runs_root: str | Path, experiment: str) -> dict[str, str]:
    """SLURM job id per submitted key (`<run key>` or `profile:<run key>`), from the journal."""
    return {k: e["job_id"] for k, e in journal(runs_root, experiment).items() if e.get("scheduler") == "slurm"}


def _scheduler_lines(cmd: list[str]) -> list[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.splitlines() if out.returncode == 0 else []


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """State per job id (array tasks as `<job>_<task>`): squeue for live jobs (sacct can lag behind a submission),
    sacct for finished ones; `VANISHED` when neither knows the job."""
    if not job_ids:
        return {}
    bases = ",".join(sorted({j.split("_")[0] for j in job_ids}))
    lines = _scheduler_lines(["sacct", "-n", "-P", "-X", "--format=JobID,State", "-j", bases])
    lines += _scheduler_lines(["squeue", "-h", "-o", "%i|%T", "-j", bases])
    states: dict[str, str] = {}
    for line in lines:
        jid, _, state = line.partition("|")
        jid, state = jid.strip(), state.split()[0] if state.strip() else "UNKNOWN"
        if "[" in jid:  # array tasks not started yet are listed as one line: 12_[3-8%4]
            base, _, spec = jid.partition("_[")
            for task in _expand(spec.split("%")[0].rstrip("]")):
                states[f"{base}_{task}"] = state
        states[jid] = state
    return {j: states.get(j, "VANISHED") for j in job_ids}


def _expand(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def check_slurm() -> None:
    try:
        ok = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise StudyError("cluster", f"SLURM is not reachable ({err})",
                         "start it (eval \"$(slurm/local/up)\") or use cluster=local") from None
    if ok.returncode != 0:
        raise StudyError("cluster", f"SLURM is not reachable: {ok.stderr.strip()}",
                         "check SLURM_CONF, or start the local cluster with eval \"$(slurm/local/up)\"")


