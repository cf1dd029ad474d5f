"""How a decay branch waits for its trunk (study.plan.branches).

A branch starts from its trunk's checkpoint at its branch step while the trunk trains on, so a SLURM dependency on
the trunk's job (held until the trunk ends) will not do: a branch whose start is not written yet is submitted held
(`sbatch --hold`), and the trunk's job releases it (`scontrol release`) right after writing that checkpoint; a
relaunch releases those whose start exists (a trunk killed before releasing). Locally the trunks' stage runs first."""

from __future__ import annotations

import subprocess
import sys

from study.config.identity import branch_key
from study.config.run import Role
from study.config.spec import RunSpec
from study.launch.scheduler import journal
from study.schema import RunDir
from study.train.checkpoint import _step_of, at_step, latest


def trunk_dir(branch: RunSpec) -> RunDir:
    """The run directory of the branch's trunk."""
    return RunDir.of(branch.config.paths.runs, branch.config.experiment, str(branch.trunk))


def branch_ready(branch: RunSpec) -> bool:
    """The branch's start exists: its trunk's complete checkpoint at the branch step."""
    return at_step(trunk_dir(branch).path, branch.first_step) is not None


def trunk_past(branch: RunSpec) -> bool:
    """The trunk has trained past the branch step without keeping its checkpoint there (a later checkpoint, or its
    result.json): no job of the trunk writes that start again, since each resumes at its latest checkpoint."""
    trunk = trunk_dir(branch)
    last = latest(trunk.path)
    return not branch_ready(branch) and (trunk.result.is_file()
                                         or (last is not None and _step_of(last) > branch.first_step))


def release(job_ids: list[str]) -> None:
    """`scontrol release` of held jobs (a job no longer held, or gone, is left as it is)."""
    if job_ids:
        subprocess.run(["scontrol", "release", ",".join(job_ids)], capture_output=True, text=True)


def release_branches(trunk: RunSpec, step: int) -> None:
    """Release the SLURM jobs of the trunk's branches that start at `step` (the trunk's job calls this after writing
    that checkpoint)."""
    keys = {branch_key(trunk.key, p.at, trunk.config.train.decay_fraction) for p in trunk.points if p.start == step}
    entries = journal(trunk.config.paths.runs, trunk.config.experiment)
    ids = [e["job_id"] for k, e in entries.items() if k in keys and e.get("scheduler") == "slurm"]
    release(ids)
    if ids:
        print(f"released branch jobs {', '.join(ids)} at step {step}", file=sys.stderr, flush=True)


def release_ready(runs: list[RunSpec], jobs: dict[str, dict], states: dict[str, str]) -> list[str]:
    """Release the pending SLURM jobs of branches whose start exists (a relaunch's repair); returns their ids."""
    ids = [jobs[r.key]["job_id"] for r in runs
           if r.role == Role.branch and r.key in jobs and jobs[r.key].get("scheduler") == "slurm"
           and states.get(jobs[r.key]["job_id"]) == "PENDING" and branch_ready(r)]
    release(ids)
    return ids
