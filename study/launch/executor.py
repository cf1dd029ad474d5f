"""submitit executors per job kind: the resources of a kind's jobs (study.launch.kinds), and the sbatch script a dry
run shows."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from study.config.cluster import ClusterConfig
from study.launch.kinds import JobKind
from study.schema import submitit_dir

if TYPE_CHECKING:
    from study.plan.planner import Plan


def build_executor(cluster: ClusterConfig, folder: Path, name: str, kind: JobKind, preview: bool = False,
                   after: Sequence[str] = (), condition: str = "afterok", held: bool = False,
                   python: str | None = None):
    """The one way to build a submitit executor (every stage, the relaunch after tuning, `--until-decided`'s controller
    and `study calibrate`): its jobs are given the resources of their `kind` (`JobKind.resources`: the preset's
    layout, one rank for a profile, one CPU-only task for data preparation, one CPU for a controller). A `preview`
    one only writes the sbatch script a dry run shows, so it is built where SLURM is not installed (a laptop checking
    a cluster launch). On SLURM its jobs wait for the jobs `after` (`condition`: afterok, afterany), and are submitted
    `held` (`sbatch --hold`) when asked; local processes run in order and wait for nothing, each started by `python`
    when given (the launching process's warm server, `study.launch.warm.shared`), else by this interpreter."""
    import submitit

    cluster = kind.resources.of(cluster)
    if cluster.name == "local":
        ex = submitit.LocalExecutor(folder=str(folder), python=python)
        ex.update_parameters(timeout_min=cluster.time_min, tasks_per_node=cluster.tasks_per_node)
        return ex
    kind = _preview_executor() if preview else submitit.SlurmExecutor
    ex = kind(folder=str(folder), max_num_timeout=cluster.max_requeues)
    tasks = cluster.gpus_per_node or cluster.tasks_per_node
    params = dict(job_name=name, time=cluster.time_min, nodes=cluster.nodes, ntasks_per_node=tasks,
                  cpus_per_task=cluster.cpus_per_task, signal_delay_s=cluster.signal_delay_s,
                  array_parallelism=cluster.array_parallelism, setup=list(cluster.setup),
                  additional_parameters={"requeue": True, **({"hold": True} if held else {})})
    if after:
        params["dependency"] = f"{condition}:" + ":".join(after)
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cluster, key):
            params[key] = getattr(cluster, key)
    if cluster.mem_gb:
        params["mem"] = f"{cluster.mem_gb}GB"
    ex.update_parameters(**params)
    return ex


def _preview_executor():
    import submitit

    class Preview(submitit.SlurmExecutor):
        """submitit's SLURM executor as the dry run uses it: its sbatch writer, without submitit's check that srun
        exists (nothing is submitted)."""

        @classmethod
        def affinity(cls) -> int:
            return 1

    return Preview


def job_name(text: str) -> str:
    """A SLURM job name (`<experiment>-<what its jobs do>`, mostly a job kind's word): anything but letters, digits,
    '_', '.' and '-' becomes '_'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def sbatch_preview(plan: Plan, kind: JobKind, count: int, after: list[str], held: bool = False,
                   cluster: ClusterConfig | None = None) -> str:
    """The sbatch script a stage's array of `count` jobs of `kind` would be submitted with (`--dry-run`; pinned by a
    golden file), on `cluster` (the stage's layout; the plan's first run's when not given)."""
    cfg = plan.runs[0].config
    folder = submitit_dir(cfg.paths.runs, cfg.experiment)
    ex = build_executor(cluster or cfg.cluster, folder, job_name(f"{cfg.experiment}-{kind}"), kind, preview=True,
                        after=after, held=held)
    from submitit.slurm.slurm import _make_sbatch_string

    # submitit's own writer, as submission uses it; `map_count` is how it writes the --array line
    params = {**ex.parameters, **({"map_count": count} if count > 1 else {})}
    return _make_sbatch_string(command="python -u -m submitit.core._submit '%j'", folder=ex.folder, **params)
