"""`study launch EXPERIMENT --until-decided`: the sequential loop of :mod:`analysis.sequential` on real launches.

Each round is an ordinary launch with the seeds added so far (in the launch manifest, so `study status` sees them),
waited on; each look is logged to the experiment's `until-decided` MLflow run. On SLURM the loop runs in a CPU
controller job, which a requeue or relaunch replays from the store (its finished runs) to where it was."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import submitit

from study.errors import StudyError


@dataclass
class Adaptive(submitit.helpers.Checkpointable):
    """Everything one adaptive launch needs, so the same object runs in the shell or as a controller job (called),
    which a time-limit warning requeues."""

    experiment: str
    """Experiment name."""
    overrides: list[str]
    """The launch's overrides (cluster=... and settings)."""
    max_seeds: int | None = None
    """Most seed pairs per comparison; None: the experiment's seeds + 3."""
    max_gpu_hours: float | None = None
    """Most estimated GPU-hours in total; None: no cap."""
    new_runs: bool = False
    """Passed to the first round's launch (see `study launch --new-runs`)."""

    def run(self, echo=print):
        """Run the loop here and now; returns the :class:`analysis.sequential.Outcome`."""
        from study.track.query import open_store
        from analysis.run_table import experiment_id, read_runs
        from analysis.sequential import Caps, log_look, until_decided
        from study.launch.status import experiment_status
        from study.launch.submit import LaunchFailed, launch
        from study.plan.planner import plan_experiment

        plan = plan_experiment(self.experiment, self.overrides)
        exp = plan.experiment
        caps = Caps(self.max_seeds or max(len(s) for s in exp.seeds.values()) + 3, self.max_gpu_hours)
        uri = plan.runs[0].config.tracking.uri
        hours = {(r.config.variant, r.config.scale): r.gpu_hours() or 0.0 for r in plan.runs}
        extra: dict[str, dict[str, set[int]]] = {}
        state = {"run_id": None, "looks": []}

        def execute(runs):
            for variant, scale, seed in runs:
                if seed not in exp.seeds[scale]:
                    extra.setdefault(scale, {}).setdefault(variant, set()).add(seed)
            seeds = {s: {v: sorted(x) for v, x in vs.items()} for s, vs in extra.items()}
            # every round after the first (which follows a look) adds seeds: new runs
            launch(self.experiment, self.overrides, wait=True, echo=echo, new=self.new_runs or bool(state["looks"]),
                   extra_seeds=seeds)
            # a look would count a failed run as a missing pair and add seeds for it: stop instead, naming the runs
            wanted = {f"{v}-{scale}-s{seed}" for v, scale, seed in runs}
            rows = experiment_status(self.experiment, self.overrides,
                                     plan_experiment(self.experiment, self.overrides, seeds))
            unfinished = [f"{r.name} ({r.key}): {r.verdict}" for r in rows if r.name in wanted and not r.state.done]
            if unfinished:
                raise LaunchFailed(f"{len(unfinished)} runs of this round did not finish: {'; '.join(unfinished)}. "
                                   f"`study status {self.experiment}` says why; the same command again resumes "
                                   "them and carries on")

        def record(look):
            state["looks"].append(look)
            client = open_store(uri, required=True)
            state["run_id"] = log_look(client, experiment_id(client, self.experiment), state["run_id"], look,
                                       state["looks"])
            counts = ", ".join(f"{n} {v}" for v, n in sorted(look["verdicts"].items()))
            echo(f"look {look['round']}: {look['n']} seed pairs, alpha {look['alpha']:.4g} "
                 f"(spent {look['alpha_spent']:.4g}): {counts}"
                 + (f"; adding {', '.join(look['added'])}" if look["added"] else ""))

        outcome = until_decided(exp.decision, exp.baseline, exp.seeds, [v.name for v in exp.variants], execute,
                                lambda: read_runs(self.experiment, uri), lambda run: hours[run[0], run[1]], caps,
                                record)
        echo(f"{self.experiment}: stopped after {len(outcome.looks)} looks: {outcome.stopped} "
             f"(about {outcome.gpu_hours:,.1f} GPU-hours of training)")
        return outcome

    def __call__(self) -> str:
        return self.run(echo=lambda line: print(line, flush=True)).stopped


def until_decided(experiment: str, overrides: list[str], max_seeds: int | None, max_gpu_hours: float | None,
                  new_runs: bool = False, echo=print) -> int:
    """`study launch --until-decided`: in this shell on `cluster=local`, in a controller job on SLURM."""
    from study.launch.scheduler import check_slurm, outside_allocation
    from study.launch.kinds import JobKind, build_executor, job_name
    from study.plan.planner import plan_experiment
    from study.schema import submitit_dir

    if max_seeds is not None and max_seeds < 2:
        raise StudyError("--max-seeds", f"is {max_seeds}", "pass 2 or more: a paired test needs 2 pairs")
    if max_gpu_hours is not None and not max_gpu_hours > 0:
        raise StudyError("--max-gpu-hours", f"is {max_gpu_hours}", "pass a positive number of GPU-hours")
    adaptive = Adaptive(experiment, list(overrides), max_seeds, max_gpu_hours, new_runs)
    cfg = plan_experiment(experiment, overrides).runs[0].config
    if cfg.cluster.name == "local":
        adaptive.run(echo)
        return 0
    check_slurm()
    ex = build_executor(cfg.cluster, submitit_dir(cfg.paths.runs, experiment) / "%j",
                        job_name(f"{experiment}-{JobKind.until_decided}"), JobKind.until_decided)
    with outside_allocation():
        job = ex.submit(adaptive)
    echo(f"{experiment}: the adaptive loop runs in controller job {job.job_id}; its looks go to the MLflow run "
         f"'until-decided' of experiment {experiment}, its log to {job.paths.stdout}")
    sys.stdout.flush()
    return 0
