"""`study calibrate EXPERIMENT cluster=...`: one short training job per distinct shape of the experiment, on the
cluster preset the study will run on; the measured tokens/s (and MFU on GPUs) go to the tracking store, where
`study plan` reads them for its GPU-hours (study/plan/throughput.py).

A calibration job trains a copy of one run of that shape (same model, batch, precision and devices) for `steps` steps
without evaluation, in the MLflow experiment and run folder `study-calibration`. Its figure is the median logged
`train/tokens_per_s` after the warm-up. A shape calibrated on that preset is not submitted again unless `--again`."""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from study import schema
from study.config.recipe import resolve_recipe
from study.config.run import Role
from study.config.spec import RunSpec, write_spec
from study.errors import StudyError
from study.plan.planner import plan_experiment
from study.plan.throughput import (CALIBRATION_EXPERIMENT, MFU, PER_DEVICE, TAG_CLUSTER, TAG_SHAPE, TOKENS_PER_S,
                                   devices, measured, shape_key)
from study.schema import RunDir, submitit_dir

WARMUP_FRACTION = 0.25
"""The first steps left out of the figure: allocation, compilation and cache warm-up are not the steady state."""
MIN_STEPS = 8
"""Fewer steps leave too few logged points after warm-up for a median."""


def calibration_specs(experiment: str, overrides: list[str], steps: int) -> list[RunSpec]:
    """One calibration spec per distinct shape of the experiment's runs (pending geometry runs have none yet)."""
    if steps < MIN_STEPS:
        raise StudyError("--steps", f"{steps} steps", f"use --steps {MIN_STEPS} or more (a quarter is warm-up)")
    plan = plan_experiment(experiment, overrides)
    shapes: dict[str, RunSpec] = {}
    for run in plan.runs:
        if run.params is not None:
            shapes.setdefault(shape_key(run), run)
    out = []
    for key, run in shapes.items():
        cfg = run.config
        train = replace(cfg.train, max_steps=steps, log_interval=1, val_interval=steps, ckpt_interval=steps,
                        keep_last=1, val_batches=1)
        config = replace(cfg, experiment=CALIBRATION_EXPERIMENT, role=Role.calibrate, seed=0, train=train,
                         eval=replace(cfg.eval, after_train=False))
        name = f"{cfg.variant}-{cfg.scale}-{cfg.cluster.name}"
        rdir = RunDir.of(cfg.paths.runs, CALIBRATION_EXPERIMENT, f"{key}-{cfg.cluster.name}")
        out.append(replace(run, key=f"{key}-{cfg.cluster.name}", name=name, config=config, dir=str(rdir.path),
                           depends_on=[], recipe=resolve_recipe(config, run.budget)))
    return out


def calibrate(experiment: str, overrides: list[str], steps: int = 40, again: bool = False,
              echo: Callable[[str], None] = print) -> dict[str, float]:
    """Submits what is not calibrated yet, waits for it, records the figures; returns shape -> tokens/s/device."""
    from study.launch.kinds import JobKind, build_executor
    from study.launch.local import check_local_layout, failure_reason
    from study.launch.scheduler import check_slurm, outside_allocation
    from study.track.store import retire_runs

    specs = calibration_specs(experiment, overrides, steps)
    cluster = specs[0].config.cluster
    if cluster.name == "local":
        check_local_layout(cluster)
    else:
        check_slurm()
    done = measured(specs[0].config.tracking.uri)
    todo = [s for s in specs if again or cluster.name not in done.get(shape_key(s), {})]
    for spec in specs:
        if spec not in todo:
            figure = done[shape_key(spec)][cluster.name]
            echo(f"  calibrated  {spec.name}: {figure.tokens_per_s_per_device:,.0f} tokens/s per device")
    if todo:
        for spec in todo:
            if again:  # a fresh measurement, not a resumed one, and the only run of its key
                shutil.rmtree(spec.run_dir.path, ignore_errors=True)
                retire_runs(spec.key, CALIBRATION_EXPERIMENT, spec.config.tracking, "measured again (--again)")
            write_spec(spec)
        ex = build_executor(cluster, submitit_dir(specs[0].config.paths.runs, CALIBRATION_EXPERIMENT) / "%j",
                            f"{experiment}-{JobKind.calibrate}", JobKind.calibrate)
        with outside_allocation(), ex.batch():
            jobs = [ex.submit(JobKind.calibrate.job(s.dir)) for s in todo]
        echo(f"calibrate {experiment}: {len(todo)} shapes on {cluster.name}, {steps} steps each "
             f"(jobs {', '.join(j.job_id for j in jobs)})")
        failed = []
        for spec, job in zip(todo, jobs):
            try:
                job.results()  # every task's: a job of several ranks (or nodes) has no single result
            except Exception as err:  # noqa: BLE001 - every shape is waited for, then the failures are named
                failed.append(f"{spec.name}: {failure_reason(err)}")
                continue
            figure = record(spec)
            echo(f"  measured    {spec.name}: {figure:,.0f} tokens/s per device")
        if failed:
            raise StudyError("calibrate", f"{len(failed)} calibration jobs failed: {'; '.join(failed)}",
                             "read the job logs in <runs>/study-calibration/_submitit, fix, and calibrate again")
    now = measured(specs[0].config.tracking.uri)
    return {s.name: now[shape_key(s)][cluster.name].tokens_per_s_per_device for s in specs}


def record(spec: RunSpec) -> float:
    """The calibration run's steady-state figures, as its metrics and tags; returns tokens/s per device."""
    from mlflow.entities import Metric, RunTag

    from study.track.query import runs_by_key
    from study.track.store import mlflow_client, resolve_tracking_uri

    run = runs_by_key(CALIBRATION_EXPERIMENT, spec.config.tracking.uri)[spec.key]
    client = mlflow_client(resolve_tracking_uri(spec.config.tracking.uri))

    def steady(metric: str) -> list[float]:
        return [m.value for m in client.get_metric_history(run.info.run_id, metric)
                if m.step > WARMUP_FRACTION * spec.config.train.max_steps]

    if not (tokens := steady(schema.TRAIN_TOKENS_PER_S)):
        raise StudyError("calibrate", f"{spec.name} logged no tokens/s after warm-up",
                         "calibrate with more --steps")
    tps = statistics.median(tokens)
    metrics = {TOKENS_PER_S: tps, PER_DEVICE: tps / devices(spec)}
    if mfu := steady(schema.TRAIN_MFU):
        metrics[MFU] = statistics.median(mfu)
    now = int(time.time() * 1000)
    client.log_batch(run.info.run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
                     tags=[RunTag(TAG_SHAPE, spec.key.split("-", 1)[0]), RunTag(TAG_CLUSTER, spec.config.cluster.name)],
                     synchronous=True)
    return metrics[PER_DEVICE]
