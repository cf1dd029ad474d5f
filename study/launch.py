"""`study launch`: submit what an experiment still needs, as SLURM job arrays (or local processes), idempotently.

Stages: training runs (the reference runs among them) -> geometry profiles of finished references -> runs
scheduled from those profiles, chained with `afterok`. A run whose key is FINISHED in MLflow is skipped, and so is one
whose job is still pending or running; a failed or vanished run is submitted again and resumes from its checkpoint.
Every submission is appended to <runs>/<experiment>/_launch/jobs.jsonl so `study status` can name the job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from study.config import ClusterConfig, RunConfig, run_key
from study.errors import StudyError
from study.plan import Plan, PlannedRun, plan_experiment, profile_path, run_dir

ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD",
          "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}


@dataclass
class Stage:
    name: str
    """`train`, `profile` or `scheduled`."""
    runs: list[PlannedRun]
    """Runs (or, for `profile`, the reference runs to profile)."""
    after: list[str] = field(default_factory=list)
    """Job ids this stage waits for (afterok)."""
    job_ids: list[str] = field(default_factory=list)
    """Filled on submission."""


def launch_dir(plan: Plan) -> Path:
    cfg = plan.runs[0].cfg
    return Path(cfg.paths.runs).resolve() / cfg.experiment / "_launch"


def journal(plan: Plan) -> dict[str, dict]:
    """Latest submission per run key (and per `profile:<key>`)."""
    path = launch_dir(plan) / "jobs.jsonl"
    out: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                out[entry["key"]] = entry
    return out


def record(plan: Plan, entries: list[dict]) -> None:
    path = launch_dir(plan) / "jobs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for e in entries:
            f.write(json.dumps(e) + "\n")


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


def finished_keys(experiment: str, tracking_uri: str = "") -> dict[str, str]:
    """MLflow status per run key in the experiment (one batch query)."""
    from study.mlflow_store import mlflow_client, sqlite_path
    from study.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():  # nothing tracked yet; reading must not create a store
        return {}
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    status: dict[str, str] = {}
    token = None
    while True:
        page = client.search_runs([exp.experiment_id], max_results=1000, page_token=token)
        for r in page:
            key = r.data.tags.get("study.run_key")
            if key:
                status[key] = r.info.status
        token = page.token
        if not token:
            return status


def to_submit(plan: Plan) -> tuple[list[PlannedRun], list[PlannedRun], list[PlannedRun], dict[str, str]]:
    """(train runs, references to profile, scheduled runs) that still need a job; plus MLflow status per key."""
    cfg0 = plan.runs[0].cfg
    status = finished_keys(plan.experiment.name, cfg0.tracking.uri)
    jobs = journal(plan)
    states = slurm_states([e["job_id"] for e in jobs.values() if e.get("scheduler") == "slurm"])

    def busy(key: str) -> bool:
        entry = jobs.get(key)
        if not entry or entry.get("scheduler") != "slurm":
            return False
        return states.get(entry["job_id"], "VANISHED") in ACTIVE

    train = [r for r in plan.runs if r.cfg.stage != "scheduled" and status.get(r.key) != "FINISHED" and not busy(r.key)]
    refs = {d for r in plan.runs if r.cfg.stage == "scheduled" for d in r.depends_on}
    profile = [r for r in plan.runs if r.key in refs and not profile_path(r.cfg, r.key).is_file()
               and not busy(f"profile:{r.key}")]
    scheduled = [r for r in plan.runs if r.cfg.stage == "scheduled" and status.get(r.key) != "FINISHED"
                 and not busy(r.key)]
    return train, profile, scheduled, status


def _executor(cluster: ClusterConfig, folder: Path, name: str, single: bool = False):
    """submitit executor for a stage; `single` gives one rank (and at most one GPU) for profiling jobs."""
    import submitit

    if single:
        cluster = replace(cluster, nodes=1, tasks_per_node=1, gpus_per_node=min(1, cluster.gpus_per_node))

    if cluster.name == "local":
        ex = submitit.LocalExecutor(folder=str(folder))
        ex.update_parameters(timeout_min=cluster.time_min, tasks_per_node=cluster.tasks_per_node)
        return ex
    ex = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=cluster.max_requeues)
    tasks = cluster.gpus_per_node or cluster.tasks_per_node
    params = dict(job_name=name, time=cluster.time_min, nodes=cluster.nodes, ntasks_per_node=tasks,
                  cpus_per_task=cluster.cpus_per_task, signal_delay_s=cluster.signal_delay_s,
                  array_parallelism=cluster.array_parallelism, setup=list(cluster.setup),
                  additional_parameters={"requeue": True})
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cluster, key):
            params[key] = getattr(cluster, key)
    if cluster.mem_gb:
        params["mem"] = f"{cluster.mem_gb}GB"
    ex.update_parameters(**params)
    return ex


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def sbatch_preview(plan: Plan, stage: str, count: int, after: list[str]) -> str:
    """The sbatch script a stage's array would be submitted with (`--dry-run`; pinned by a golden file)."""
    cfg = plan.runs[0].cfg
    folder = Path(cfg.paths.runs).resolve() / cfg.experiment / "_submitit"
    ex = _executor(cfg.cluster, folder, _safe_name(f"{cfg.experiment}-{stage}"), single=stage == "profile")
    if after:
        ex.update_parameters(dependency="afterok:" + ":".join(after))
    from submitit.slurm.slurm import _make_sbatch_string

    # submitit's own writer, as submission uses it; `map_count` is how it writes the --array line
    params = {**ex.parameters, **({"map_count": count} if count > 1 else {})}
    return _make_sbatch_string(command="python -u -m submitit.core._submit '%j'", folder=ex.folder, **params)


def submit_stage(plan: Plan, stage: Stage) -> list[str]:
    from study.jobs import ProfileJob, TrainJob

    cfg = plan.runs[0].cfg
    folder = Path(cfg.paths.runs).resolve() / cfg.experiment / "_submitit" / "%j"
    ex = _executor(cfg.cluster, folder, _safe_name(f"{cfg.experiment}-{stage.name}"), single=stage.name == "profile")
    if stage.after and cfg.cluster.name != "local":
        ex.update_parameters(dependency="afterok:" + ":".join(stage.after))
    make = ProfileJob if stage.name == "profile" else TrainJob
    try:
        jobs = _submit_array(ex, [make(r.cfg) for r in stage.runs])
    except Exception as err:  # sbatch's own message is the useful part
        raise StudyError("cluster", f"submission of the {stage.name} stage failed: {err}",
                         "check the cluster profile (partition, account, qos, time limit) against `sinfo`") from None
    ids = [j.job_id for j in jobs]
    scheduler = "local" if cfg.cluster.name == "local" else "slurm"
    prefix = "profile:" if stage.name == "profile" else ""
    record(plan, [{"key": prefix + r.key, "job_id": j, "stage": stage.name, "scheduler": scheduler,
                   "name": r.name, "time": time.time()} for r, j in zip(stage.runs, ids)])
    stage.job_ids = ids
    return jobs


def _submit_array(ex, callables: list) -> list:
    with ex.batch():
        jobs = [ex.submit(c) for c in callables]
    return jobs


def plan_stages(plan: Plan) -> list[Stage]:
    """The stages still to submit, with their dependencies on jobs submitted now or still active."""
    train, profile, scheduled, _ = to_submit(plan)
    submitted = slurm_jobs(plan)
    stages = []
    if train:
        stages.append(Stage("train", train))
    if profile:
        stages.append(Stage("profile", profile))
    if scheduled:
        stages.append(Stage("scheduled", scheduled))
    for stage in stages:
        stage.after = dependencies(stage, submitted)
    return stages


def slurm_jobs(plan: Plan) -> dict[str, str]:
    """SLURM job id per submitted key (`<run key>` or `profile:<run key>`), from the journal."""
    return {k: e["job_id"] for k, e in journal(plan).items() if e.get("scheduler") == "slurm"}


def dependencies(stage: Stage, submitted: dict[str, str]) -> list[str]:
    """Exactly the upstream array tasks of a stage's runs (a reference run, its profile), not whole arrays."""
    return sorted({submitted[k] for r in stage.runs for k in _upstream(stage.name, r) if k in submitted})


def _upstream(stage: str, run: PlannedRun) -> list[str]:
    if stage == "profile":
        return [run.key]
    if stage == "scheduled":
        return [f"profile:{k}" for k in run.depends_on]
    return []


def launch(experiment: str, overrides: list[str], dry_run: bool = False, wait: bool = False, echo=print) -> list[Stage]:
    """Submit every stage that still has work; returns the stages (with job ids unless dry_run)."""
    plan = plan_experiment(experiment, overrides)
    cluster = plan.runs[0].cfg.cluster
    if cluster.name != "local" and not dry_run:
        _check_slurm()
    stages = plan_stages(plan)
    if not stages:
        echo(f"{experiment}: nothing to submit, every planned run is finished or in the queue")
        return []
    if dry_run:
        previous: list[str] = []
        for stage in stages:
            upstream = {"profile": "reference runs", "scheduled": "profiles"}.get(stage.name)
            after = stage.after + ([f"<its {upstream} in the {previous[-1]} array>"] if previous and upstream else [])
            echo(f"stage {stage.name}: array of {len(stage.runs)} runs"
                 + (f", afterok on {', '.join(after)}" if after else ""))
            for run in stage.runs:
                echo(f"  {run.key}  {run.name}")
            echo(sbatch_preview(plan, stage.name, len(stage.runs), after) if cluster.name != "local"
                 else "  (local processes, no sbatch script)")
            previous.append(stage.name)
        return stages
    if cluster.name == "local":
        return _launch_local(plan, stages, echo)
    submitted = slurm_jobs(plan)
    for stage in stages:
        stage.after = dependencies(stage, submitted)  # now including the stages submitted just before
        jobs = submit_stage(plan, stage)
        prefix = "profile:" if stage.name == "profile" else ""
        submitted.update({prefix + r.key: j.job_id for r, j in zip(stage.runs, jobs)})
        echo(f"stage {stage.name}: submitted {len(jobs)} runs as array {jobs[0].job_id.split('_')[0]}"
             + (f" (afterok {','.join(stage.after)})" if stage.after else ""))
        for run, job in zip(stage.runs, jobs):
            echo(f"  {job.job_id}  {run.key}  {run.name}")
    if wait:
        follow(plan, echo)
    return stages


def _check_slurm() -> None:
    try:
        ok = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise StudyError("cluster", f"SLURM is not reachable ({err})",
                         "start it (eval \"$(slurm/local/up)\") or use cluster=local") from None
    if ok.returncode != 0:
        raise StudyError("cluster", f"SLURM is not reachable: {ok.stderr.strip()}",
                         "check SLURM_CONF, or start the local cluster with eval \"$(slurm/local/up)\"")


def _launch_local(plan: Plan, stages: list[Stage], echo) -> list[Stage]:
    """Laptop mode: stages run one after the other, `array_parallelism` processes at a time."""
    parallel = max(1, plan.runs[0].cfg.cluster.array_parallelism)
    failures = []
    for stage in stages:
        echo(f"stage {stage.name}: {len(stage.runs)} runs, {parallel} at a time (local)")
        for i in range(0, len(stage.runs), parallel):
            chunk = Stage(stage.name, stage.runs[i:i + parallel])
            jobs = submit_stage(plan, chunk)
            for run, job in zip(chunk.runs, jobs):
                try:
                    job.result()
                    echo(f"  done    {run.key}  {run.name}")
                except Exception as err:  # a failed run must not stop its siblings
                    failures.append(run)
                    echo(f"  FAILED  {run.key}  {run.name}: {str(err).strip().splitlines()[-1]}")
            stage.job_ids += [j.job_id for j in jobs]
    if failures:
        echo(f"{len(failures)} runs failed; `study launch` again resumes them from their checkpoints")
    return stages


def follow(plan: Plan, echo, poll_s: float = 5.0) -> None:
    """Wait until no submitted job of the experiment is pending or running, showing counts by state."""
    from rich.live import Live

    with Live(refresh_per_second=1, transient=False) as live:
        while True:
            jobs = journal(plan)
            ids = [e["job_id"] for e in jobs.values() if e.get("scheduler") == "slurm"]
            states = slurm_states(ids)
            counts: dict[str, int] = {}
            for j in ids:
                st = states.get(j, "VANISHED")
                counts[st] = counts.get(st, 0) + 1
            live.update(" ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
            if not any(states.get(j) in ACTIVE for j in ids):
                break
            time.sleep(poll_s)
