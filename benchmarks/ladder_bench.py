"""The ladder end to end: `study launch ladder cluster=local`, then `study report ladder`, in a fresh folder.

What it costs and where the CPU goes: wall seconds of the launch and of the report, CPU seconds of every process the
launch started (the launcher, its warm server, submitit's clients, the jobs: `getrusage` of the children, which reaps
them all), and of each job by what it did: tune runs, trunks, branches, the evaluation of the branches that end the
planned runs. A job's CPU is read from `/proc` twice a second while it runs; what it spends until it releases its run
directory's lease (`.lease`, held from the start of training to its end) is its training, what it spends after is
its evaluation (beyond the median after-lease CPU of the jobs that do not evaluate) and `after`: racing's settle and
the process's exit. The rest of the launch (imports, planning, MLflow parents, the warm server) is `launcher`. What racing saved: the planned GPU-hours of the runs its stops left
untrained (the racing record) as a share of all trunks' and branches', beside the share the plan predicts
(`study.plan.racing.expected_saving`: every arm worse by twice the margin, no arm different, and at the effects and
seed noise this ladder measured at its largest point). Then the report's headline numbers.

`--quick` runs the reduced ladder of tests/test_ladder.py instead (2 arms x 3 sizes of 8k-33k parameters x 2 seeds, no
tuning, no evaluation): minutes, not half an hour. The data cache is filled by a first `study prepare` that is not
timed.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from benchmarks.common import load_average, row

ROOT = Path(__file__).resolve().parents[1]

REDUCED = {"lt16": (16, 16), "lt24": (24, 24), "lt32": (32, 32)}
"""The reduced ladder's sizes: d_model and steps (2 layers, a 4 d_model FFN, 4 x 32 tokens a step)."""


def reduced_ladder(tree: Path) -> dict:
    """A copy of sweeps/ at ``tree`` whose `ladder` is the shipped one cut down: 2 arms (conventional, hourglass), the
    sizes of REDUCED, seeds 0 and 1, branches at 0.5 and 1 (decay 0.25), no tuning (the recipe's LR), no evaluation.
    Racing, the decision rule and the schedule are the shipped file's."""
    shutil.copytree(ROOT / "sweeps", tree)
    ladder = yaml.safe_load((ROOT / "sweeps" / "experiment" / "ladder.yaml").read_text())
    for name, (d, steps) in REDUCED.items():
        (tree / "scale" / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump({
            "scale": name, "budget": {"tolerance": 5e-2}, "data": {"seq_len": 32},
            "model": {"d_model": d, "n_layers": 2, "n_heads": 1, "vocab_size": 512, "max_seq_len": 32,
                      "ffn": {"width": 4 * d}},
            "train": {"micro_batch": 4, "max_steps": steps, "lr": 0.01, "warmup_steps": 2, "val_interval": 8,
                      "val_batches": 2, "ckpt_interval": 1000}}))
    del ladder["tune"]
    ladder.update(scales=list(REDUCED), seeds=[0, 1], branches={"at": [0.5, 1.0], "decay": 0.25},
                  variants={"conventional": ladder["variants"]["conventional"],
                            "hourglass": {"model": "hourglass", "at": {s: {"model.n_layers": 1} for s in REDUCED}}})
    ladder["common"].update(data={"vocab_size": 512, "max_docs": 1500, "val_fraction": 0.05},
                            eval={"after_train": False}, tracking={"system_metrics_s": 0})
    (tree / "experiment" / "ladder.yaml").write_text(yaml.safe_dump(ladder))
    return ladder


class JobCpu:
    """CPU seconds of the jobs a launch forks, sampled from /proc: per run key, while it holds its lease and after."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, root_pid: int, runs: Path, every_s: float = 0.5):
        self.root, self.runs, self.every = root_pid, str(runs), every_s
        self.jobs: dict[int, dict] = {}  # pid -> {key, train, total}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "JobCpu":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            for pid in self._descendants():
                self._sample(pid)

    def _descendants(self) -> list[int]:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = [], [self.root]
        while frontier:
            kids = [p for p, parent in parents.items() if parent in frontier]
            found += kids
            frontier = kids
        return found

    @staticmethod
    def _is_job(pid: int) -> bool:
        """A job: forked by the warm server (its command line is the server's) or started by submitit (cold)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"_serve" in cmdline or b"submitit.core._submit" in cmdline

    def _sample(self, pid: int) -> None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / self.TICK
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            return
        lease = next((link for link in links if link.startswith(self.runs) and link.endswith("/.lease")), None)
        job = self.jobs.get(pid)
        if lease is not None and job is None and not self._is_job(pid):
            lease = None  # another process looking at a run directory (a lease probe), not a job training it
        if lease is not None:
            key = Path(lease).parent.name
            job = self.jobs.setdefault(pid, {"key": key, "train": 0.0, "total": 0.0})
            job["train"] = cpu
        if job is not None:
            job["total"] = cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _busy_cpu() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat): what else ran beside the figure."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / JobCpu.TICK


def _spec(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())["config"]


def _parts(jobs: dict[int, dict], runs: Path) -> dict[str, float]:
    """CPU seconds by what the jobs did (a run resumed by a second job counts both): training by role (while the
    job holds its lease, its start included), evaluation (what an evaluating job spends after its lease beyond the
    median of the jobs that do not evaluate) and `after` (the rest after the lease: racing's settle, the process's
    exit)."""
    parts = {"tune": 0.0, "trunk": 0.0, "branch": 0.0, "evaluation": 0.0, "after": 0.0}
    evaluates = {pid: _spec(runs / job["key"])["eval"]["after_train"] for pid, job in jobs.items()}
    quiet = sorted(job["total"] - job["train"] for pid, job in jobs.items() if not evaluates[pid])
    typical = quiet[len(quiet) // 2] if quiet else 0.0
    for pid, job in jobs.items():
        role = _spec(runs / job["key"])["role"]
        parts[role if role in parts else "branch"] += job["train"]
        after = job["total"] - job["train"]
        if evaluates[pid]:
            parts["evaluation"] += max(after - typical, 0.0)
            after = min(after, typical)
        parts["after"] += after
    return {k: round(v, 1) for k, v in parts.items()}


def _racing(folder: Path, report: dict) -> dict:
    """What the race stopped and saved (planned GPU-hours, as a share of every trunk's and branch's), beside the
    plan's expected saving for the experiment's settings and for what this ladder measured."""
    from study.plan.experiment import load_experiment
    from study.plan.racing import expected_saving

    roster = json.loads((folder / "runs" / "ladder" / "_launch" / "racing.json").read_text())
    planned = sum(r["gpu_hours"] or 0.0 for r in roster["runs"])
    record = report.get("racing") or {}
    saved = sum(s.get("gpu_hours_saved") or 0.0 for s in record.get("stops") or [])
    exp = load_experiment("ladder")
    d, b = exp.decision, exp.branches
    arms, seeds = len(exp.variants) - 1, min(len(s) for s in exp.seeds.values())
    common = dict(at=b.at, decay=b.decay, arms=arms, seeds=seeds, alpha=d.alpha, margin=d.margin,
                  stop_equivalent=exp.racing.stop_equivalent)
    primary = [x for x in report["decisions"] if x["family"] == "primary" and x["n"] > 1]
    # the ladder's own effects and noise: each arm's mean paired delta over the scales, the median sd of the deltas
    by_arm = {}
    for x in primary:
        by_arm.setdefault(x["variant"], []).append(x["mean_delta"])
    sds = sorted(x["sd_delta"] for x in primary if x.get("sd_delta") is not None)
    measured_sd = sds[len(sds) // 2] if sds else d.prior_sd
    return {
        "stops": [{k: s.get(k) for k in ("variant", "scale", "at", "verdict", "gpu_hours_saved")}
                  for s in record.get("stops") or []],
        "verdicts_recorded": len(record.get("verdicts") or []),
        "saved_share": saved / planned if planned else 0.0,
        "predicted_share_every_arm_worse_by_2_margins": expected_saving(**common, sd=d.prior_sd,
                                                                         effect=2 * (d.margin or d.prior_sd)),
        "predicted_share_no_arm_different": expected_saving(**common, sd=d.prior_sd, effect=None),
        "predicted_share_at_measured_effects": expected_saving(
            **{**common, "arms": len(by_arm) or arms}, sd=measured_sd,
            effect=[sum(v) / len(v) for v in by_arm.values()] or None),
        "measured_sd": measured_sd,
    }


def _headline(report: dict) -> dict:
    """The numbers the report leads with: verdicts, each arm's multiplier and optimum at the largest scale,
    effective compute over the fitted range, the tuning's choices."""
    surface = report.get("surface") or {}
    largest = {m["variant"]: m for m in surface.get("multipliers") or []}
    optima = {o["variant"]: o for o in surface.get("optima") or []}
    compute = [r for r in (report.get("effective_compute") or {}).get("rows") or [] if r.get("fitted_range")]
    return {
        "verdicts": [{k: x[k] for k in ("scale", "variant", "mean_delta", "verdict")} for x in report["decisions"]
                     if x["family"] == "primary"],
        "surface_form": surface.get("form"),
        "multiplier_at_largest": {v: {k: m[k] for k in ("scale", "multiplier", "ci_low", "ci_high", "interval")}
                                  for v, m in largest.items()},
        "optimum_at_largest": {v: {k: o[k] for k in ("scale", "compute", "n_opt", "d_opt", "planned_n",
                                                        "planned_d")} for v, o in optima.items()},
        "effective_compute_fitted_range": {r["variant"]: {k: r[k] for k in ("multiplier", "ci_low", "ci_high")}
                                           for r in compute},
        "tuning": {c["variant"]: {k: c.get(k) for k in ("chosen_multiple", "status", "main_lrs")}
                   for c in (report.get("tuning") or {}).get("curves") or []},
    }


def run(quick: bool) -> list[dict]:
    folder = Path(tempfile.mkdtemp(prefix="ladder-bench-"))
    # the launch's own warm server, so its jobs are the launcher's descendants (a shared one's are not)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "STUDY_WARM_SERVER")}
    if quick:
        reduced_ladder(folder / "sweeps")
        env["STUDY_SWEEPS"] = str(folder / "sweeps")
    study = [sys.executable, "-m", "study.cli"]
    subprocess.run([*study, "prepare", "ladder"], cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    load, busy, cpu = load_average(), _busy_cpu(), _children_cpu()
    start = time.perf_counter()
    with open(folder / "launch.log", "w") as log:
        launcher = subprocess.Popen([*study, "launch", "ladder", "cluster=local"], cwd=folder, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        with JobCpu(launcher.pid, folder / "runs" / "ladder") as sampled:
            if launcher.wait() != 0:
                raise RuntimeError(f"study launch ladder failed: see {folder / 'launch.log'}")
    launch_wall, launch_cpu = time.perf_counter() - start, _children_cpu() - cpu
    start, cpu = time.perf_counter(), _children_cpu()
    subprocess.run([*study, "report", "ladder"], cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    report_wall, report_cpu = time.perf_counter() - start, _children_cpu() - cpu
    machine_busy = _busy_cpu() - busy
    report = json.loads((folder / "reports" / "ladder" / "report.json").read_text())
    parts = _parts(sampled.jobs, folder / "runs" / "ladder")
    parts["launcher"] = round(launch_cpu - sum(parts.values()), 1)
    with_env = dict(os.environ)
    try:
        if quick:
            os.environ["STUDY_SWEEPS"] = env["STUDY_SWEEPS"]
        racing = _racing(folder, report)
    finally:
        os.environ.clear()
        os.environ.update(with_env)
    extra = dict(experiment="ladder (reduced: tests/test_ladder.py)" if quick else "ladder", jobs=len(sampled.jobs),
                 load_avg=[load, load_average()], machine_busy_cpu_s=round(machine_busy, 1))
    shutil.rmtree(folder, ignore_errors=True)  # its checkpoints: 3 GB for the whole ladder (kept when a step fails)
    wall = launch_wall + report_wall
    rows = [
        row("ladder end to end: study launch + study report, wall seconds (peer: the 30-minute aim on 2 cores)",
            round(wall, 1), None if quick else 1800.0, "s", "lower", launch_s=round(launch_wall, 1),
            report_s=round(report_wall, 1), **extra),
        row("ladder CPU seconds of every process the launch and the report started, by part", round(
            launch_cpu + report_cpu, 1), None, "s", "lower", parts={**parts, "report": round(report_cpu, 1)}, **extra),
        row("ladder racing: share of the planned trunk and branch GPU-hours saved (peer: the plan's expected share "
            "at the effects and noise this ladder measured)", round(racing["saved_share"], 4),
            round(racing["predicted_share_at_measured_effects"], 4), "share", "higher", racing=racing, **extra),
        row("ladder report headline", None, None, "", "higher", headline=_headline(report), **extra),
    ]
    return rows
